"""Scenario 23: database clock steps under load -> 0 renewals after a seen expiry.

The server is a private throwaway cluster running under libfaketime (Debian ``faketime``)
with its offset read from a file on every clock read, so the scenario steps the clock of
every backend at once, mid-load, as a failover to a host whose clock differs or an NTP
step would. Holder threads (a store and coordinator each) keep renewing their leases; one
that is refused anything drops its handle, as a keeper does, and takes the lease over once
it has expired. A rival thread keeps reading every lease (``current_holder``).

Before each step back, two holders are frozen until the rival has seen their leases
expire; the clock steps back; they resume and renew at once. Judged:

* renewals (or releases) that started after the rival saw that lease expired: 0;
* writes stamped earlier than their row's previous stamp (audit log, per identity): 0;
* every step back was refused with its reason: each saw ``clock_behind`` refusals, and each
  frozen holder's first renewal after it was refused ``clock_behind``.

What cannot be seen (docs): a step back shorter than the time since a row's last write.
Here every step back (3 s) is longer than any lease goes unwritten (a frozen holder resumes
within about a second), which is the condition under which the figures hold.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mos_lease import ConnectorLeaseCoordinator, LeaseHandle, LeaseIdentity, Reason
from mos_lease.vocabulary import LeaseState
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from mos_lease_pg.admin import migrate
from tests.faults.gateway import SCOPES, no_preempt_policy
from tests.faults.history import AuditRow
from tests.faults.support import PrivateCluster, Table, audit_rows, create_db, scaled
from tests.tools import require_tools

pytestmark = [pytest.mark.faults, pytest.mark.pg]

TTL = 0.8
BEAT_S = 0.05  # pause between a holder's calls
STEP_BACK = 3.0  # seconds; longer than any lease here goes unwritten
STEP_FORWARD = 2.0  # longer than the TTL: every lease held ends at once
SETTLE_S = 4.5  # after each step: a step back freezes every row for up to STEP_BACK + TTL
FROZEN_PER_STEP = 2


def stepped_clock(offset_file: Path) -> dict[str, str]:
    """The environment that runs the server on a clock shifted by what ``offset_file`` says
    (``+2s``, ``-3s``), read again on every clock read; its monotonic clock stays real."""
    found = glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
    if not found:
        message = "libfaketime is not installed (Debian package faketime)"
        if require_tools():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return {"LD_PRELOAD": found[0], "FAKETIME_TIMESTAMP_FILE": str(offset_file),
            "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


@dataclass
class Call:
    identity: str
    op: str
    epoch: int
    start: float  # host monotonic
    end: float
    ok: bool
    reason: str | None


@dataclass
class Seen:
    identity: str
    epoch: int
    end: float  # host monotonic: the read's reply had arrived


@dataclass
class Shared:
    calls: list[Call] = field(default_factory=list)
    seen_expired: list[Seen] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # Before each step and at the end: did the server's clock still show the offset set?
    offset_held: list[bool] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _store(dsn: str) -> PostgresLeaseStore:
    return PostgresLeaseStore(dsn, settings=ConnectionSettings(
        statement_timeout=timedelta(seconds=3), lock_timeout=timedelta(seconds=2),
        connect_timeout=3.0, application_name="faults-clock-steps"))


class Holder(threading.Thread):
    """Renews its lease; refused anything, drops its handle and takes over after expiry."""

    def __init__(self, dsn: str, identity: LeaseIdentity, shared: Shared) -> None:
        super().__init__(daemon=True)
        self.identity = identity
        self.shared = shared
        self.store = _store(dsn)
        self.gateway = ConnectorLeaseCoordinator(self.store, no_preempt_policy())
        self.frozen = threading.Event()  # set: do nothing until cleared
        self.resumed = threading.Event()
        self.handle: LeaseHandle | None = None
        self.epoch = 0
        self.after_resume: list[Call] = []  # the first renewal after each freeze

    def _record(self, op: str, epoch: int, start: float, result: Any) -> Call:
        call = Call(self.identity.binding_id, op, epoch, start, time.monotonic(), result.ok,
                    None if result.reason is None else str(result.reason))
        with self.shared.lock:
            self.shared.calls.append(call)
        return call

    def run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # reported by the test
            self.shared.errors.append(f"{self.identity.binding_id}: {exc!r}")
        finally:
            self.store.close()

    def _loop(self) -> None:
        while not self.shared.stop.is_set():
            if self.frozen.is_set():
                self.resumed.wait(30)
                self.resumed.clear()
                if self.handle is not None:
                    # Renew at once: the call a step back must refuse.
                    start = time.monotonic()
                    result = self.gateway.heartbeat(self.handle, ttl=TTL)
                    self.after_resume.append(self._record("heartbeat", self.handle.epoch,
                                                          start, result))
                    self._after(result)
                continue
            start = time.monotonic()
            if self.handle is not None:
                epoch = self.handle.epoch
                result = self.gateway.heartbeat(self.handle, ttl=TTL)
                self._record("heartbeat", epoch, start, result)
            elif self.epoch == 0:
                result = self.gateway.acquire(self.identity, "holder", scopes=SCOPES, ttl=TTL)
                self._record("acquire", 1, start, result)
            else:
                result = self.gateway.takeover(self.identity, "holder", scopes=SCOPES,
                                               ttl=TTL, expected_epoch=self.epoch)
                self._record("takeover", self.epoch + 1, start, result)
            self._after(result)
            time.sleep(BEAT_S)

    def _after(self, result: Any) -> None:
        if result.ok:
            self.handle = result.lease
            self.epoch = result.lease.epoch
        else:
            self.handle = None  # a keeper stops at any refusal
            if result.current_epoch is not None:
                self.epoch = result.current_epoch


class Rival(threading.Thread):
    """Reads every lease in turn and notes each one it sees expired."""

    def __init__(self, dsn: str, identities: list[LeaseIdentity], shared: Shared) -> None:
        super().__init__(daemon=True)
        self.identities = identities
        self.shared = shared
        self.store = _store(dsn)
        self.gateway = ConnectorLeaseCoordinator(self.store, no_preempt_policy())

    def run(self) -> None:
        try:
            while not self.shared.stop.is_set():
                for identity in self.identities:
                    view = self.gateway.current_holder(identity)
                    if view is not None and view.state is LeaseState.EXPIRED:
                        with self.shared.lock:
                            self.shared.seen_expired.append(
                                Seen(identity.binding_id, view.epoch, time.monotonic()))
                time.sleep(0.01)
        except Exception as exc:
            self.shared.errors.append(f"rival: {exc!r}")
        finally:
            self.store.close()


@dataclass
class Step:
    by: float
    at: float  # host monotonic, just before the offset file was written
    frozen: list[Holder]
    seen_after: float | None  # seconds until the server's clock showed it (None: never)


def _write_offset(offset_file: Path, offset: float) -> None:
    # Replaced, never rewritten in place: the server reads the file on every clock read, and
    # must never find it empty or half written.
    staged = offset_file.with_suffix(".new")
    staged.write_text(f"{offset:+g}s\n")
    staged.chmod(0o644)
    os.replace(staged, offset_file)


def _seen(shared: Shared, holder: Holder) -> bool:
    with shared.lock:
        return any(s.identity == holder.identity.binding_id and s.epoch == holder.epoch
                   for s in shared.seen_expired)


def _server_offset(probe: psycopg.Connection[Any]) -> float:
    """The server clock minus this host's (which libfaketime leaves alone), in seconds."""
    before = time.time()
    row = probe.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
    after = time.time()
    assert row is not None
    return float(row[0]) - (before + after) / 2


def _confirm(probe: psycopg.Connection[Any], offset: float) -> float | None:
    """Seconds until the server's clock showed ``offset`` (``None``: not within 5 s)."""
    began = time.monotonic()
    while time.monotonic() < began + 5:
        if abs(_server_offset(probe) - offset) < 0.25:
            return time.monotonic() - began
        time.sleep(0.005)
    return None


def _drive(dsn: str, offset_file: Path, steps: list[float], shared: Shared,
           holders: list[Holder], rng: random.Random) -> list[Step]:
    offset, done = 0.0, []
    probe = psycopg.connect(dsn, autocommit=True)
    held = shared.offset_held
    for by in steps:
        time.sleep(SETTLE_S)
        held.append(abs(_server_offset(probe) - offset) < 0.25)
        frozen: list[Holder] = []
        if by < 0:
            frozen = [h for h in rng.sample(holders, FROZEN_PER_STEP) if h.handle is not None]
            for holder in frozen:
                holder.frozen.set()
            deadline = time.monotonic() + TTL + 3
            while (time.monotonic() < deadline
                   and not all(_seen(shared, h) for h in frozen)):
                time.sleep(0.02)
            frozen = [h for h in frozen if _seen(shared, h)]
        offset += by
        at = time.monotonic()  # a call that ends after this may have read the new clock
        _write_offset(offset_file, offset)
        # The holders resume only once the server's clock is seen to have stepped.
        done.append(Step(by, at, frozen, _confirm(probe, offset)))
        for holder in holders:
            if holder.frozen.is_set():
                holder.frozen.clear()
                holder.resumed.set()
    time.sleep(SETTLE_S)
    held.append(abs(_server_offset(probe) - offset) < 0.25)
    probe.close()
    return done


def _stamps_backwards(rows: list[AuditRow]) -> list[str]:
    """Successful writes stamped earlier than their row's previous stamp."""
    found: list[str] = []
    last: dict[tuple[str, str, str], AuditRow] = {}
    for row in sorted(rows, key=lambda r: r.seq):
        if row.outcome == "denied":
            continue
        previous = last.get(row.identity)
        if previous is not None and row.recorded_at < previous.recorded_at:
            found.append(f"{row.identity[2]} {row.outcome} seq {row.seq} at {row.recorded_at} "
                         f"< seq {previous.seq} at {previous.recorded_at}")
        last[row.identity] = row
    return found


@dataclass
class Run:
    done: list[Step]
    rows: list[AuditRow]


def _run(steps: list[float], identities: int, shared: Shared) -> Run:
    """Holders and a rival on a private cluster whose clock steps by ``steps``."""
    # A directory of its own, not pytest's: the server (another OS user when we are root)
    # reads the file on every clock read, and a pytest session starting meanwhile makes its
    # own base directory private again. Unreadable, the offset would silently fall to zero.
    where = Path(tempfile.mkdtemp(prefix="mos-lease-clock-"))
    where.chmod(0o755)
    offset_file = where / "offset"
    _write_offset(offset_file, 0)
    cluster = PrivateCluster(env=stepped_clock(offset_file))
    try:
        cluster.start()
        dsn = create_db(cluster.dsn, "faults")
        migrate(dsn)
        tenant = f"clk-{os.getpid()}"
        ids = [LeaseIdentity(tenant, "agent", f"b{i}") for i in range(identities)]
        holders = [Holder(dsn, ident, shared) for ident in ids]
        rival = Rival(dsn, ids, shared)
        for thread in (*holders, rival):
            thread.start()
        try:
            done = _drive(dsn, offset_file, steps, shared, holders, random.Random(23))
        finally:
            shared.stop.set()
            for thread in (*holders, rival):
                thread.join(30)
        with psycopg.connect(dsn, autocommit=True) as admin:
            return Run(done, audit_rows(admin, tenant))
    finally:
        cluster.close()
        shutil.rmtree(where, ignore_errors=True)


def _save(path: Path, done: list[Step], shared: Shared) -> None:
    """The run's steps, calls and observations, one JSON object a line, for a post mortem."""
    with path.open("w", encoding="utf-8") as out:
        for step in done:
            out.write(json.dumps({"step": step.by, "at": step.at, "seen": step.seen_after,
                                  "frozen": [h.identity.binding_id for h in step.frozen]}) + "\n")
        for call in shared.calls:
            out.write(json.dumps({"call": asdict(call)}) + "\n")
        for seen in shared.seen_expired:
            out.write(json.dumps({"seen": asdict(seen)}) + "\n")


def test_clock_steps_on_the_server(soak: bool, figures: Table, tmp_path: Path) -> None:
    pairs = scaled(soak, 2, 6)  # (forward, back) pairs
    identities = scaled(soak, 6, 8)
    steps = [STEP_FORWARD, -STEP_BACK] * pairs
    shared = Shared()
    run = _run(steps, identities, shared)
    done, rows = run.done, run.rows

    calls = shared.calls
    history = tmp_path / "history.jsonl"
    _save(history, done, shared)
    renewed_after_seen = [
        c for c in calls if c.ok and c.op in ("heartbeat", "release")
        and any(s.identity == c.identity and s.epoch == c.epoch and s.end < c.start
                for s in shared.seen_expired)]
    backwards = _stamps_backwards(rows)
    backs = [s for s in done if s.by < 0]
    # A refusal belongs to the last step made before it ended (its clock was read by then).
    per_step = Counter(max((i for i, s in enumerate(done) if s.at < c.end), default=-1)
                       for c in calls if c.reason == Reason.CLOCK_BEHIND)
    per_back = [per_step[i] for i, s in enumerate(done) if s.by < 0]
    frozen = [(s, h) for s in backs for h in s.frozen]
    # Each frozen holder's first renewal once the clock had stepped back.
    firsts = [min((c for c in h.after_resume if c.start >= s.at), key=lambda c: c.start,
                  default=None) for s, h in frozen]
    frozen_refused = [c for c in firsts if c is not None and c.reason == Reason.CLOCK_BEHIND]
    # How long each frozen lease went unwritten before that renewal: the condition for the
    # step back to be seen is that it is longer (module docstring).
    gaps = [first.start - max(c.start for c in calls if c.identity == h.identity.binding_id
                              and c.ok and c.start < s.at)
            for (s, h), first in zip(frozen, firsts, strict=True) if first is not None]
    writes = Counter(f"{c.op} {'ok' if c.ok else c.reason}" for c in calls)
    audited_behind = sum(r.reason == Reason.CLOCK_BEHIND for r in rows)
    forward_takeovers = sum(c.ok and c.op == "takeover" for c in calls)

    figures.add("spec. figure / this run",
                f"forward and backward steps under load / {pairs} x (+{STEP_FORWARD:g} s, "
                f"-{STEP_BACK:g} s), {identities} holders + 1 rival, ttl {TTL:g} s")
    figures.counts("steps made", len(steps), len(done))
    confirmed = [s.seen_after for s in done if s.seen_after is not None]
    figures.add("steps seen on the server's clock (max seconds after the write)",
                f"{len(confirmed)} of {len(done)} ({max(confirmed, default=0.0):.3f} s)",
                "all", len(confirmed) == len(done))
    figures.add("server clock still at the set offset before each step and at the end",
                f"{sum(shared.offset_held)} of {len(shared.offset_held)}", "all",
                all(shared.offset_held) and len(shared.offset_held) == len(done) + 1)
    figures.add("calls by outcome", dict(sorted(writes.items())))
    figures.add("expiries seen by the rival", len(shared.seen_expired), ">= 1 per frozen holder",
                len({(s.identity, s.epoch) for s in shared.seen_expired}) >= len(frozen))
    figures.add("renewals/releases started after the rival saw that lease expired",
                len(renewed_after_seen), "0", not renewed_after_seen)
    figures.add("writes stamped before their row's previous stamp (audit)", len(backwards),
                "0", not backwards)
    figures.add("clock_behind refusals after each step back", per_back, ">= 1 each",
                len(per_back) == len(backs) and all(n >= 1 for n in per_back))
    figures.add("frozen holders (seen expired, then the clock stepped back)",
                len(frozen), f">= {len(backs)}", len(frozen) >= len(backs))
    figures.add("  whose first renewal after it was refused clock_behind",
                f"{len(frozen_refused)} of {len(frozen)}", "all",
                len(frozen_refused) == len(frozen))
    figures.add("  longest such a lease went unwritten (s)", max(gaps, default=0.0),
                f"< {STEP_BACK:g} (the step back)", max(gaps, default=0.0) < STEP_BACK)
    figures.add("clock_behind refusals audited", audited_behind, "= refusals seen",
                audited_behind == sum(c.reason == Reason.CLOCK_BEHIND for c in calls))
    figures.add("takeovers won (after expiries, forward steps included)", forward_takeovers)
    figures.add("errors in holder or rival threads", len(shared.errors), "0",
                not shared.errors)
    for text in (backwards[:5] + [str(c) for c in renewed_after_seen[:5]]
                 + shared.errors[:5]):
        figures.notes.append(text)
    if figures.failed():
        figures.notes.append(f"steps, calls and observations: {history}")
    assert not figures.failed(), figures.render()
