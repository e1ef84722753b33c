"""How soon a holder learns that a rival took its lease over: with notices, and without.

Each trial: a holder holds a fresh identity (TTL 3 s, so the no-notice case, which waits for
the next heartbeat at about a third of the TTL, stays short); a rival on its own connection
takes the lease over (preemption); the time runs from the moment the rival's takeover call
returned (the commit, seen from the client) to the holder's ``on_lost``. Half the trials
give the holder a :class:`~mos_lease_pg.LeaseNotices`, half do not, interleaved. The floor
is a ``SELECT 1`` round trip on the rival's connection, measured in the same run: a notice
cannot arrive sooner than about one round trip.

Correctness is asserted: every trial's holder reports the loss, as a superseded epoch.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

import attrs
from common import SCOPES, CorrectnessError, store_connection

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity, Reason, hold
from mos_lease.holder import HoldCallbacks, HoldTiming
from mos_lease_pg import LeaseNotices, PostgresLeaseStore

TTL = 3.0  # seconds
LISTEN_WAIT = 5.0


@attrs.frozen
class NoticeResult:
    with_ms: list[float]
    without_ms: list[float]
    floor_ms: float  # p50 of a SELECT 1 round trip

    @property
    def with_p50_ms(self) -> float:
        return statistics.median(self.with_ms)

    @property
    def without_p50_ms(self) -> float:
        return statistics.median(self.without_ms)


def _trial(holder: ConnectorLeaseCoordinator, rival: ConnectorLeaseCoordinator,
           identity: LeaseIdentity, notices: LeaseNotices | None) -> float:
    lost_at: list[float] = []
    lost = threading.Event()

    def on_lost(_loss: object) -> None:
        lost_at.append(time.monotonic())
        lost.set()

    with hold(holder, identity, "holder", scopes=SCOPES, ttl=TTL, notices=notices,
              timing=HoldTiming(clock_step=0), callbacks=HoldCallbacks(on_lost=on_lost)) as held:
        taken = rival.takeover(identity, "rival", scopes=SCOPES, ttl=TTL,
                               expected_epoch=held.lease.epoch)
        committed = time.monotonic()
        if not taken.ok:
            raise CorrectnessError(f"notices: the rival's takeover was refused: {taken.reason}")
        if not lost.wait(TTL + 2):
            raise CorrectnessError("notices: the holder never reported its loss")
        loss = held.lost
        if loss is None or loss.reason is not Reason.STALE_EPOCH:
            raise CorrectnessError(f"notices: unexpected loss {loss}")
    return (lost_at[0] - committed) * 1000


def run(dsn: str, tenant: str, *, trials: int) -> NoticeResult:
    # Every trial ends in a loss the engine logs as a WARNING: expected here, not news.
    keeper_log = logging.getLogger("mos_lease.supervisor")
    level = keeper_log.level
    keeper_log.setLevel(logging.ERROR)
    try:
        return _run(dsn, tenant, trials)
    finally:
        keeper_log.setLevel(level)


def _run(dsn: str, tenant: str, trials: int) -> NoticeResult:
    with PostgresLeaseStore(dsn) as held_store, PostgresLeaseStore(dsn) as rival_store, \
            LeaseNotices(dsn) as notices:
        if not notices.listening.wait(LISTEN_WAIT):
            raise CorrectnessError(f"notices: could not LISTEN ({notices.refused})")
        holder = ConnectorLeaseCoordinator(held_store, AllowAllPolicy())
        rival = ConnectorLeaseCoordinator(rival_store, AllowAllPolicy())
        conn = store_connection(rival_store)
        floor = []
        for _ in range(50):
            started = time.perf_counter()
            conn.execute(b"SELECT 1").fetchone()
            floor.append((time.perf_counter() - started) * 1000)
        with_ms, without_ms = [], []
        for i in range(trials):
            with_ms.append(_trial(holder, rival, LeaseIdentity(tenant, "notice", f"w{i}"),
                                  notices))
            without_ms.append(_trial(holder, rival, LeaseIdentity(tenant, "notice", f"o{i}"),
                                     None))
    return NoticeResult(with_ms, without_ms, statistics.median(floor))
