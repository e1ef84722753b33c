"""Eight processes racing a takeover of one identity, round after round.

Every round, all workers meet at a barrier and then try to take the lease over at the epoch
they all know is current (it rises by exactly one per round, because exactly one worker wins
each round). The library race calls ``ConnectorLeaseCoordinator.takeover`` (read, policy,
compare-and-set; a loser rereads, names its refusal and audits it). The raw race sends only
the compare-and-set statement, parameters built before the round's barrier. Blocks of the two
races alternate (ABBA...) in the same worker processes, each on its own dedicated connection.

Correctness is asserted, not assumed: exactly one winner in every round of both races, every
library loser got a typed refusal (never an exception), and afterwards the row's epoch and
the audit log agree with the number of rounds.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from typing import Any
from uuid import uuid4

import attrs
from common import (
    LEASE_TTL,
    SCOPES,
    TTL,
    CorrectnessError,
    entry,
    raw_write,
    run_raw,
    store_connection,
    written,
)

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.machine import Rotate
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg import PostgresLeaseStore
from tests.pg_support import gather

PROCESSES = 8
BARRIER_TIMEOUT = 120.0

# (block, round, worker, won, refusal reason or "", error or "")
Attempt = tuple[int, int, int, bool, str, str]


@attrs.frozen
class Block:
    mode: str  # "library" or "raw"
    rounds: int
    timed: bool


@attrs.define
class ContentionResult:
    library_rounds_per_s: float
    raw_rounds_per_s: float
    rounds: dict[str, int]
    refusals: dict[str, int]

    @property
    def ratio(self) -> float:
        return self.library_rounds_per_s / self.raw_rounds_per_s


def plan(rounds: int, blocks: int) -> list[Block]:
    """A short untimed warm-up of each race, then timed blocks in ABBA order."""
    per_block = max(1, rounds // blocks)
    warm = [Block("library", min(10, per_block), False), Block("raw", min(10, per_block), False)]
    order = ["library", "raw", "raw", "library"]
    return warm + [Block(order[k % 4], per_block, True) for k in range(blocks)]


def worker(number: int, dsn: str, identities: dict[str, tuple[str, str, str]],
           epochs: dict[str, int], blocks: list[Block], barrier: Any, results: Any) -> None:
    attempts: list[Attempt] = []
    timings: list[float] = []
    error = ""
    try:
        with PostgresLeaseStore(dsn) as store:
            coord = ConnectorLeaseCoordinator(store, AllowAllPolicy())
            conn = store_connection(store)
            ids = {mode: LeaseIdentity(*parts) for mode, parts in identities.items()}
            epoch = dict(epochs)
            me = f"racer-{number}"
            for b, block in enumerate(blocks):
                identity = ids[block.mode]
                barrier.wait(BARRIER_TIMEOUT)
                started = time.perf_counter()
                for r in range(block.rounds):
                    expected = epoch[block.mode]
                    if block.mode == "raw":
                        raw = raw_write(
                            store, Rotate(identity, expected, True, uuid4(), me, SCOPES, TTL),
                            entry(LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER, identity, me,
                                  expected + 1))
                    barrier.wait(BARRIER_TIMEOUT)
                    if block.mode == "raw":
                        won, reason, failure = written(run_raw(conn, raw)), "", ""
                    else:
                        try:
                            result = coord.takeover(identity, me, scopes=SCOPES, ttl=LEASE_TTL,
                                                    expected_epoch=expected)
                            won = result.ok
                            reason = "" if result.reason is None else result.reason.value
                            failure = ""
                        except Exception as exc:  # a loser must be refused, never raise
                            won, reason, failure = False, "", repr(exc)
                    attempts.append((b, r, number, won, reason, failure))
                    epoch[block.mode] = expected + 1
                barrier.wait(BARRIER_TIMEOUT)
                timings.append(time.perf_counter() - started)
    except BaseException as exc:  # reported to the parent, which fails the run
        error = repr(exc)
        barrier.abort()
    results.put((number, attempts, timings, error))


def run(dsn: str, tenant: str, *, rounds: int, blocks: int) -> ContentionResult:
    schedule = plan(rounds, blocks)
    identities: dict[str, tuple[str, str, str]] = {}
    epochs: dict[str, int] = {}
    with PostgresLeaseStore(dsn) as store:
        coord = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        for mode in ("library", "raw"):
            identity = LeaseIdentity(tenant, "contended", mode)
            first = coord.acquire(identity, "racer-setup", scopes=SCOPES, ttl=LEASE_TTL)
            if first.lease is None:
                raise CorrectnessError(f"contention setup refused: {first.reason}")
            identities[mode] = (identity.tenant_id, identity.logical_agent_id,
                                identity.binding_id)
            epochs[mode] = first.lease.epoch

    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    workers = [context.Process(target=worker, args=(n, dsn, identities, epochs, schedule,
                                                    barrier, results))
               for n in range(PROCESSES)]
    try:
        reports: list[tuple[int, list[Attempt], list[float], str]] = gather(
            workers, results, BARRIER_TIMEOUT * 2)
    except TimeoutError as late:
        raise CorrectnessError(f"racers: {late}") from None
    errors = [error for *_, error in reports if error]
    if errors:
        raise CorrectnessError(f"racer failed: {errors[0]}")
    return _check(dsn, tenant, schedule, reports, epochs)


def _check(dsn: str, tenant: str, schedule: list[Block],
           reports: list[tuple[int, list[Attempt], list[float], str]],
           epochs: dict[str, int]) -> ContentionResult:
    attempts = [a for _, worker_attempts, _, _ in reports for a in worker_attempts]
    failures = [a[5] for a in attempts if a[5]]
    if failures:
        raise CorrectnessError(f"a racer got an exception instead of a refusal: {failures[0]}")
    winners = Counter((b, r) for b, r, _, won, _, _ in attempts if won)
    for b, block in enumerate(schedule):
        for r in range(block.rounds):
            if winners[(b, r)] != 1:
                raise CorrectnessError(
                    f"{block.mode} race block {b} round {r}: {winners[(b, r)]} winners")
    refusals = Counter(reason for b, _, _, won, reason, _ in attempts
                       if not won and schedule[b].mode == "library")
    if "" in refusals:
        raise CorrectnessError("a library loser got neither a lease nor a refusal reason")

    totals = {mode: sum(b.rounds for b in schedule if b.mode == mode)
              for mode in ("library", "raw")}
    with PostgresLeaseStore(dsn) as store:
        for mode, total in totals.items():
            identity = LeaseIdentity(tenant, "contended", mode)
            row = store.load(identity).row
            if row is None or row.epoch != epochs[mode] + total:
                raise CorrectnessError(f"{mode} race: epoch {None if row is None else row.epoch}"
                                       f" after {total} rounds from {epochs[mode]}")
        identity = LeaseIdentity(tenant, "contended", "library")
        audit = store.audit(identity, limit=1_000_000)
        taken = sum(1 for a in audit if a.entry.outcome is Outcome.TAKEN_OVER)
        denied = sum(1 for a in audit if a.entry.event is LifecycleEvent.TAKEOVER
                     and a.entry.outcome is Outcome.DENIED)
        if taken != totals["library"] or denied != totals["library"] * (PROCESSES - 1):
            raise CorrectnessError(f"library race audit: {taken} takeovers, {denied} denials "
                                   f"for {totals['library']} rounds")

    # Timing from worker 0's view of the barrier (every worker passes it together).
    timings = next(t for number, _, t, _ in reports if number == 0)
    rates: dict[str, list[float]] = {"library": [0.0, 0.0], "raw": [0.0, 0.0]}
    for block, seconds in zip(schedule, timings, strict=True):
        if block.timed:
            rates[block.mode][0] += block.rounds
            rates[block.mode][1] += seconds
    return ContentionResult(
        library_rounds_per_s=rates["library"][0] / rates["library"][1],
        raw_rounds_per_s=rates["raw"][0] / rates["raw"][1],
        rounds={mode: int(rates[mode][0]) for mode in rates},
        refusals=dict(refusals))
