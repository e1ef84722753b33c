"""Pinning the client and its PostgreSQL backend to one core.

On a 2-core machine a single-connection round trip costs ~13 µs when client and backend
share a core and ~65 µs more per wake-up when they do not, and an unpinned run flips
between the two. Ratios measured side by side on one connection only mean
something when every case runs with the same placement, so the single-connection cases run
with this process and its backend(s) on one core, where that can be arranged: the server is
on this machine, its backend process is visible here, and ``taskset`` exists.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from typing import Any

import attrs
import psycopg


def _cpus() -> set[int]:
    return set(os.sched_getaffinity(0))


@attrs.define
class Pinning:
    """The pinning in force; :meth:`restore` puts every original affinity back."""

    cpu: int | None
    note: str
    _client_mask: set[int] | None = None
    # Where the backends go: ``cpu`` itself, or another core in the cross-core placement.
    backend_cpu: int | None = None
    _backends: dict[int, set[int]] = attrs.field(factory=dict)

    @property
    def applied(self) -> bool:
        return self.cpu is not None

    def add_backend(self, conn: psycopg.Connection[Any]) -> None:
        """Pin one more connection's backend to the same core (no-op when not pinning)."""
        if self.cpu is None:
            return
        pid, problem = _local_backend(conn)
        if pid is None:
            raise RuntimeError(f"cannot pin a second backend: {problem}")
        self._backends[pid] = os.sched_getaffinity(pid)
        _taskset(pid, {self.cpu if self.backend_cpu is None else self.backend_cpu})

    def restore(self) -> None:
        for pid, mask in self._backends.items():
            # The backend may be gone already (connection closed): nothing to restore then.
            with contextlib.suppress(OSError, subprocess.CalledProcessError):
                _taskset(pid, mask)
        self._backends.clear()
        if self._client_mask is not None:
            os.sched_setaffinity(0, self._client_mask)
            self._client_mask = None
        self.cpu = None


def _other(allowed: set[int], cpu: int) -> int:
    """The next allowed core after ``cpu`` (wrapping round)."""
    ordered = sorted(allowed)
    return next((c for c in ordered if c > cpu), ordered[0])


def _taskset(pid: int, cpus: set[int]) -> None:
    subprocess.run(["taskset", "-pc", ",".join(str(c) for c in sorted(cpus)), str(pid)],
                   check=True, capture_output=True, timeout=10)


def _local_backend(conn: psycopg.Connection[Any]) -> tuple[int | None, str]:
    """The pid of ``conn``'s backend if it is a process on this machine, else why not.

    The pid comes from the server; it names our backend here only if the server runs in
    this process namespace (not in a container). The backend's process title carries the
    client's address and port, so that is checked against our end of the socket."""
    row = conn.execute(b"SELECT pg_backend_pid()").fetchone()
    assert row is not None
    pid = int(row[0])
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().replace(b"\x00", b" ").decode("utf-8", "replace")
    except OSError:
        return None, f"backend pid {pid} is not a process on this machine"
    family = socket.AF_UNIX if conn.pgconn.host.startswith(b"/") else socket.AF_INET
    with socket.fromfd(conn.fileno(), family, socket.SOCK_STREAM) as sock:
        local = sock.getsockname()
    expected = "[local]" if family == socket.AF_UNIX else f"({local[1]})"
    if "postgres" not in title or expected not in title:
        return None, f"pid {pid} here is not our backend ({title.strip()[:60]!r})"
    return pid, ""


def pin(conn: psycopg.Connection[Any], *, cpu: int | None, enabled: bool,
        cross: bool = False) -> Pinning:
    """Pin this process and ``conn``'s backend to ``cpu`` (default: the lowest allowed core).

    With ``cross``, the backend goes to another allowed core instead (the next one up,
    wrapping): client and backend each on a core of their own, as on a machine with cores
    to spare, where every round trip pays a wake-up across cores but no Python time is
    taken from the backend. Never fails: when pinning is impossible the returned
    :class:`Pinning` says why."""
    if not enabled:
        return Pinning(None, "not pinned: --no-pin")
    if shutil.which("taskset") is None:
        return Pinning(None, "not pinned: taskset is not installed")
    allowed = _cpus()
    if len(allowed) < 2:
        return Pinning(None, f"not pinned: this process may only use CPU {sorted(allowed)}")
    target = min(allowed) if cpu is None else cpu
    if target not in allowed:
        return Pinning(None, f"not pinned: CPU {target} is not in {sorted(allowed)}")
    pid, problem = _local_backend(conn)
    if pid is None:
        return Pinning(None, f"not pinned: {problem}")
    backend = _other(allowed, target) if cross else target
    where = (f"client pid {os.getpid()} pinned to CPU {target}, backend pid {pid} to CPU "
             f"{backend} (cross-core, taskset)" if cross else
             f"client pid {os.getpid()} and backend pid {pid} pinned to CPU {target} (taskset)")
    pinning = Pinning(target, where, client_mask=allowed, backend_cpu=backend)
    try:
        pinning._backends[pid] = os.sched_getaffinity(pid)
        _taskset(pid, {backend})
        os.sched_setaffinity(0, {target})
    except (OSError, subprocess.SubprocessError) as exc:
        pinning.restore()
        return Pinning(None, f"not pinned: {exc}")
    return pinning
