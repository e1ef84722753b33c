"""A tmux server addressed by an explicit socket, driven through the ``tmux`` command."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from mos_lease.errors import MosLeaseError


class TmuxError(MosLeaseError):
    """tmux is missing, or a tmux command failed."""


@attrs.frozen(slots=True)
class TmuxServer:
    """One tmux server, always addressed with ``-S socket_path``.

    An explicit socket keeps tests and gateways off the user's default server, and gives
    the pane a stable name for fencing (socket path plus pane id).
    """

    socket_path: Path = attrs.field(converter=Path)
    tmux: str = "tmux"
    timeout: float = 10.0

    def _env(self) -> dict[str, str]:
        # Inside a tmux session $TMUX names *that* server; -S already says which one we
        # mean, and the variable would leak into the panes of a server we start.
        return {k: v for k, v in os.environ.items() if k != "TMUX"}

    def run(self, *args: str, env: Mapping[str, str] | None = None) -> str:
        """Run one tmux command line against this server; its stdout, or ``TmuxError``."""
        binary = shutil.which(self.tmux)
        if binary is None:
            raise TmuxError(f"{self.tmux!r} not found: install it (Debian: apt-get install tmux)")
        try:
            done = subprocess.run([binary, "-S", str(self.socket_path), *args],
                                  capture_output=True, text=True, timeout=self.timeout,
                                  env={**self._env(), **(env or {})}, check=False)
        except subprocess.TimeoutExpired as slow:
            raise TmuxError(f"tmux {args[0] if args else ''} timed out") from slow
        if done.returncode != 0:
            raise TmuxError(f"tmux {' '.join(args[:1])} failed ({done.returncode}): "
                            f"{done.stderr.strip()}")
        return done.stdout

    def new_session(self, name: str, command: Sequence[str] = (), *, width: int = 200,
                    height: int = 50, env: Mapping[str, str] | None = None) -> str:
        """Start a detached session (and the server, if needed); returns its pane id."""
        out = self.run("new-session", "-d", "-s", name, "-x", str(width), "-y", str(height),
                       "-P", "-F", "#{pane_id}", *command, env=env)
        return out.strip()

    def pane_id(self, target: str) -> str:
        """The stable id (``%N``) of the pane ``target`` names."""
        pane = self.run("display-message", "-p", "-t", target, "#{pane_id}").strip()
        if not pane.startswith("%"):
            raise TmuxError(f"no pane for target {target!r}")
        return pane

    def capture(self, target: str) -> str:
        """The pane's whole history and screen, wrapped lines joined."""
        return self.run("capture-pane", "-p", "-J", "-S", "-", "-t", target)

    def kill(self) -> None:
        """Stop the server (a no-op if it is not running)."""
        with contextlib.suppress(TmuxError):
            self.run("kill-server")
