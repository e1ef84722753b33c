"""The single-connection comparisons: each library call against its floors, side by side.

Every case runs on the store's own dedicated connection (so the same backend, the same
server-side prepared statements and the same core pinning):

* validate: ``ConnectorLeaseCoordinator.validate`` vs the raw prepared ``load.sql`` it sends,
  and vs a prepared ``SELECT 1`` (the round-trip floor of the machine);
* heartbeat, acquire, takeover, release: the library call vs the raw guarded-write statement
  it sends (text and parameters built by ``mos_lease_pg.statements``, before the timed
  loop), and vs :mod:`naive`;
* batched heartbeat: ``heartbeat_many`` of 100 leases vs single heartbeats, in leases/s.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID, uuid4

import attrs
import psycopg
from common import (
    LEASE_TTL,
    SCOPES,
    TTL,
    CorrectnessError,
    Raw,
    entry,
    raw_load,
    raw_write,
    run_raw,
    run_wire,
    store_wire,
    written,
)
from measure import Case, Series, interleave
from naive import Naive
from shape import Shape, trace

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    ExecutionGrant,
    LeaseHandle,
    LeaseIdentity,
)
from mos_lease.machine import Close, Insert, Renew, Rotate
from mos_lease.results import HolderView
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason
from mos_lease_pg import PostgresLeaseStore

BATCH = 100
CONNECTOR = "bench-connector"


@attrs.frozen
class Counts:
    validate_rounds: int
    validate_per_round: int
    write_rounds: int
    write_per_round: int
    batch_calls_per_round: int
    warmup: int


FULL = Counts(validate_rounds=30, validate_per_round=1000, write_rounds=15,
              write_per_round=200, batch_calls_per_round=4, warmup=200)
QUICK = Counts(validate_rounds=4, validate_per_round=150, write_rounds=3, write_per_round=25,
               batch_calls_per_round=1, warmup=20)


@attrs.define
class SingleResults:
    comparisons: dict[str, dict[str, Series]] = attrs.field(factory=dict)
    shapes: dict[str, Shape] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)


class Bench:
    """The library, its connection and its naive twin, with fresh identities on demand."""

    def __init__(self, store: PostgresLeaseStore, conn: psycopg.Connection[Any],
                 tenant: str) -> None:
        self.store = store
        self.conn = conn
        self.wire = store_wire(store)
        self.tenant = tenant
        self.coord = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        self.naive = Naive(conn)
        self._ids = itertools.count(1)

    def identity(self, kind: str) -> LeaseIdentity:
        return LeaseIdentity(self.tenant, kind, f"b{next(self._ids)}")

    def identities(self, kind: str, n: int) -> list[LeaseIdentity]:
        return [self.identity(kind) for _ in range(n)]

    def acquire(self, kind: str) -> LeaseHandle:
        result = self.coord.acquire(self.identity(kind), CONNECTOR, scopes=SCOPES,
                                    ttl=LEASE_TTL)
        if result.lease is None:
            raise CorrectnessError(f"setup acquire refused: {result.reason}")
        return result.lease

    def acquire_many(self, kind: str, n: int) -> list[LeaseHandle]:
        return [self.acquire(kind) for _ in range(n)]


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise CorrectnessError(what)


# --- validate ----------------------------------------------------------------------------


class _Grant:
    """A grant for the validated lease, re-minted (untimed) long before it could expire."""

    def __init__(self, bench: Bench, lease: LeaseHandle) -> None:
        self.bench = bench
        self.lease = lease
        self.grant: ExecutionGrant | None = None
        self.minted = 0.0

    def refresh(self, _n: int = 0) -> None:
        if self.grant is not None and time.monotonic() - self.minted < 10:
            return
        renewed = self.bench.coord.heartbeat(self.lease, ttl=LEASE_TTL)
        _check(renewed.ok, f"validated lease not renewed: {renewed.reason}")
        granted = self.bench.coord.issue_grant(self.lease, scopes=SCOPES, ttl=30)
        _check(granted.grant is not None, f"grant not issued: {granted.reason}")
        self.grant, self.minted = granted.grant, time.monotonic()


def validate_cases(bench: Bench) -> list[Case]:
    lease = bench.acquire("validate")
    holder = _Grant(bench, lease)
    holder.refresh()
    coord, conn, identity = bench.coord, bench.conn, lease.identity

    def library(_i: int) -> None:
        result = coord.validate(holder.grant, identity=identity,  # type: ignore[arg-type]
                                scopes=SCOPES)
        if result.context is None:
            raise CorrectnessError(f"validate refused: {result.reason}")

    load = raw_load(bench.store, identity)
    wire = bench.wire

    def raw(_i: int) -> None:
        run_raw(conn, load)

    def wired(_i: int) -> None:
        run_wire(wire, load)

    def select1(_i: int) -> None:
        conn.execute(b"SELECT 1", prepare=True).fetchall()

    return [Case("library", library, setup=holder.refresh), Case("raw", raw),
            Case("wire", wired), Case("select1", select1)]


# --- lifecycle writes --------------------------------------------------------------------


def _raw_cases(bench: Bench, builder: Callable[[], Callable[[int], list[Raw]]],
               what: str) -> list[Case]:
    """The statement sent the plain psycopg way ("raw") and the way the store sends it
    ("wire"). ``builder()`` gives each case its own lease(s); the parameters of a block are
    built before it, untimed."""
    def case(name: str, send: Callable[[Raw], tuple[Any, ...]]) -> Case:
        prepared: list[Raw] = []
        build = builder()

        def setup(n: int) -> None:
            prepared[:] = build(n)

        def call(i: int) -> None:
            if not written(send(prepared[i])):
                raise CorrectnessError(f"{name} {what} refused")

        return Case(name, call, setup=setup)

    conn, wire = bench.conn, bench.wire
    return [case("raw", lambda raw: run_raw(conn, raw)),
            case("wire", lambda raw: run_wire(wire, raw))]


def heartbeat_cases(bench: Bench) -> list[Case]:
    coord, store = bench.coord, bench.store
    lib_lease = bench.acquire("heartbeat")

    def library(_i: int) -> None:
        result = coord.heartbeat(lib_lease, ttl=LEASE_TTL)
        if not result.ok:
            raise CorrectnessError(f"heartbeat refused: {result.reason}")

    def builder() -> Callable[[int], list[Raw]]:
        h = bench.acquire("heartbeat")
        return lambda n: [
            raw_write(store, Renew(h.identity, h.connector_id, h.lease_id, h.epoch, TTL),
                      entry(LifecycleEvent.HEARTBEAT, Outcome.RENEWED, h.identity,
                            h.connector_id, h.epoch))
            for _ in range(n)]

    naive_lease = bench.acquire("heartbeat")

    def naive(_i: int) -> None:
        h = naive_lease
        bench.naive.heartbeat(h.identity, h.connector_id, h.lease_id, h.epoch, TTL)

    return [Case("library", library), *_raw_cases(bench, builder, "heartbeat"),
            Case("naive", naive)]


def acquire_cases(bench: Bench) -> list[Case]:
    coord, store = bench.coord, bench.store
    lib_ids: list[LeaseIdentity] = []

    def library(i: int) -> None:
        result = coord.acquire(lib_ids[i], CONNECTOR, scopes=SCOPES, ttl=LEASE_TTL)
        if not result.ok:
            raise CorrectnessError(f"acquire refused: {result.reason}")

    def builder() -> Callable[[int], list[Raw]]:
        return lambda n: [
            raw_write(store, Insert(identity, uuid4(), CONNECTOR, SCOPES, TTL),
                      entry(LifecycleEvent.ACQUIRE, Outcome.ACQUIRED, identity, CONNECTOR, 1))
            for identity in bench.identities("acquire-raw", n)]

    naive_ids: list[LeaseIdentity] = []

    def naive(i: int) -> None:
        bench.naive.acquire(naive_ids[i], CONNECTOR, list(SCOPES), TTL)

    return [
        Case("library", library,
             setup=lambda n: lib_ids.__setitem__(slice(None), bench.identities("acq-lib", n))),
        *_raw_cases(bench, builder, "acquire"),
        Case("naive", naive,
             setup=lambda n: naive_ids.__setitem__(slice(None),
                                                   bench.identities("acq-naive", n))),
    ]


@attrs.define
class _Epoch:
    value: int


def takeover_cases(bench: Bench) -> list[Case]:
    coord, store = bench.coord, bench.store
    lib_lease = bench.acquire("takeover")
    lib_epoch = _Epoch(lib_lease.epoch)

    def library(_i: int) -> None:
        # Preempting the active lease (the policy allows it): the library reads the row for
        # the policy, then sends the same compare-and-set as the raw case.
        result = coord.takeover(lib_lease.identity, CONNECTOR, scopes=SCOPES, ttl=LEASE_TTL,
                                expected_epoch=lib_epoch.value)
        if result.lease is None:
            raise CorrectnessError(f"takeover refused: {result.reason}")
        lib_epoch.value = result.lease.epoch

    def builder() -> Callable[[int], list[Raw]]:
        raw_lease = bench.acquire("takeover")
        raw_epoch = _Epoch(raw_lease.epoch)

        def build(n: int) -> list[Raw]:
            identity, first = raw_lease.identity, raw_epoch.value
            raw_epoch.value += n  # every prepared call is expected to win its compare-and-set
            return [raw_write(store, Rotate(identity, e, True, uuid4(), CONNECTOR, SCOPES, TTL),
                              entry(LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER, identity,
                                    CONNECTOR, e + 1))
                    for e in range(first, first + n)]
        return build

    naive_lease = bench.acquire("takeover")
    naive_epoch = _Epoch(naive_lease.epoch)

    def naive(_i: int) -> None:
        bench.naive.takeover(naive_lease.identity, CONNECTOR, list(SCOPES), TTL,
                             naive_epoch.value, preempt_active=True)
        naive_epoch.value += 1

    return [Case("library", library), *_raw_cases(bench, builder, "takeover"),
            Case("naive", naive), _raw_read_cas(bench), _observed_takeover(bench)]


def _raw_read_cas(bench: Bench) -> Case:
    """The honest floor of a takeover that tells its policy the current state: the raw
    read of the row, then the raw compare-and-set, plain psycopg."""
    conn, store = bench.conn, bench.store
    lease = bench.acquire("takeover-read-cas")
    epoch = _Epoch(lease.epoch)
    load = raw_load(store, lease.identity)
    prepared: list[Raw] = []

    def setup(n: int) -> None:
        first = epoch.value
        epoch.value += n
        prepared[:] = [raw_write(store, Rotate(lease.identity, e, True, uuid4(), CONNECTOR,
                                               SCOPES, TTL),
                                 entry(LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER,
                                       lease.identity, CONNECTOR, e + 1))
                       for e in range(first, first + n)]

    def call(i: int) -> None:
        run_raw(conn, load)
        if not written(run_raw(conn, prepared[i])):
            raise CorrectnessError("raw read + takeover refused")

    return Case("raw_read_cas", call, setup=setup)


def _observed_takeover(bench: Bench) -> Case:
    """The library takeover given the holder view the coordinator returned (untimed, in
    setup): the policy is told that view's state, and the write is the one round trip."""
    coord = bench.coord
    targets: list[tuple[LeaseIdentity, HolderView]] = []

    def setup(n: int) -> None:
        views = []
        for lease in bench.acquire_many("takeover-observed", n):
            view = coord.current_holder(lease.identity)
            _check(view is not None, "setup current_holder")
            assert view is not None
            views.append((lease.identity, view))
        targets[:] = views

    def call(i: int) -> None:
        identity, view = targets[i]
        result = coord.takeover(identity, CONNECTOR, scopes=SCOPES, ttl=LEASE_TTL,
                                expected_epoch=view.epoch, observed=view)
        if result.lease is None:
            raise CorrectnessError(f"observed takeover refused: {result.reason}")

    return Case("observed", call, setup=setup)


def release_cases(bench: Bench) -> list[Case]:
    coord, store = bench.coord, bench.store
    lib_leases: list[LeaseHandle] = []

    def library(i: int) -> None:
        result = coord.release(lib_leases[i])
        if not result.ok:
            raise CorrectnessError(f"release refused: {result.reason}")

    def builder() -> Callable[[int], list[Raw]]:
        return lambda n: [
            raw_write(store, Close(h.identity, h.connector_id, h.lease_id, h.epoch),
                      entry(LifecycleEvent.RELEASE, Outcome.RELEASED, h.identity,
                            h.connector_id, h.epoch))
            for h in bench.acquire_many("release-raw", n)]

    naive_leases: list[LeaseHandle] = []

    def naive(i: int) -> None:
        h = naive_leases[i]
        bench.naive.release(h.identity, h.connector_id, h.lease_id, h.epoch)

    return [
        Case("library", library,
             setup=lambda n: lib_leases.__setitem__(slice(None),
                                                    bench.acquire_many("rel-lib", n))),
        *_raw_cases(bench, builder, "release"),
        Case("naive", naive,
             setup=lambda n: naive_leases.__setitem__(slice(None),
                                                      bench.acquire_many("rel-naive", n))),
    ]


def batch_cases(bench: Bench, counts: Counts) -> list[Case]:
    coord = bench.coord
    leases = bench.acquire_many("batch", BATCH)
    single_lease = bench.acquire("batch-single")

    def batch(_i: int) -> None:
        results = coord.heartbeat_many(leases, ttl=LEASE_TTL)
        if len(results) != BATCH or not all(r.ok for r in results):
            raise CorrectnessError("batched heartbeat refused a lease")

    def single(_i: int) -> None:
        result = coord.heartbeat(single_lease, ttl=LEASE_TTL)
        if not result.ok:
            raise CorrectnessError(f"heartbeat refused: {result.reason}")

    return [Case("batch", batch, ops_per_call=BATCH, per_round=counts.batch_calls_per_round),
            Case("single", single)]


# --- wire shapes -------------------------------------------------------------------------


def shapes(bench: Bench) -> tuple[dict[str, Shape], list[str]]:
    """One warm call of each operation, traced. Also checks that a batch with one stale
    lease renews the other 99 and refuses that one with a typed reason."""
    coord, conn, notes = bench.coord, bench.conn, []
    lease = bench.acquire("shape")
    holder = _Grant(bench, lease)
    holder.refresh()
    batch = bench.acquire_many("shape-batch", BATCH)
    fresh = bench.identities("shape-acquire", 2)
    to_release = bench.acquire_many("shape-release", 2)
    taken = bench.acquire("shape-takeover")
    epoch = _Epoch(taken.epoch)
    naive_lease = bench.acquire("shape-naive")

    def validate() -> None:
        assert holder.grant is not None
        _check(coord.validate(holder.grant, identity=lease.identity, scopes=SCOPES).ok,
               "validate")

    def takeover_unobserved() -> None:
        result = coord.takeover(taken.identity, CONNECTOR, scopes=SCOPES, ttl=LEASE_TTL,
                                expected_epoch=epoch.value)
        _check(result.lease is not None, "takeover")
        assert result.lease is not None
        epoch.value = result.lease.epoch

    observed = [(lease.identity, coord.current_holder(lease.identity))
                for lease in bench.acquire_many("shape-observed", 2)]

    def observed_takeover(k: int) -> Callable[[], None]:
        def take() -> None:
            identity, view = observed[k]
            assert view is not None
            _check(coord.takeover(identity, CONNECTOR, scopes=SCOPES, ttl=LEASE_TTL,
                                  expected_epoch=view.epoch, observed=view).ok,
                   "observed takeover")
        return take

    def naive_heartbeat() -> None:
        h = naive_lease
        bench.naive.heartbeat(h.identity, h.connector_id, h.lease_id, h.epoch, TTL)

    ops: dict[str, list[Callable[[], object]]] = {
        "validate": [validate, validate],
        "heartbeat": [lambda: _check(coord.heartbeat(lease, ttl=LEASE_TTL).ok, "heartbeat")] * 2,
        "acquire": [lambda: _check(coord.acquire(fresh[0], CONNECTOR, scopes=SCOPES,
                                                 ttl=LEASE_TTL).ok, "acquire"),
                    lambda: _check(coord.acquire(fresh[1], CONNECTOR, scopes=SCOPES,
                                                 ttl=LEASE_TTL).ok, "acquire")],
        # A takeover given the view its coordinator returned: the one round trip of the
        # target. Without a view it reads the row for the policy first (two).
        "takeover": [observed_takeover(0), observed_takeover(1)],
        "takeover_unobserved": [takeover_unobserved, takeover_unobserved],
        "release": [lambda: _check(coord.release(to_release[0]).ok, "release"),
                    lambda: _check(coord.release(to_release[1]).ok, "release")],
        "heartbeat_many_100": [lambda: _check(all(
            r.ok for r in coord.heartbeat_many(batch, ttl=LEASE_TTL)), "batch")] * 2,
        "naive_heartbeat": [naive_heartbeat, naive_heartbeat],
    }
    found: dict[str, Shape] = {}
    for name, (warm, measured) in ops.items():
        warm()  # the first call of a statement on a connection also prepares it
        found[name] = trace(conn, measured)

    # One stale lease in a batch: the others are renewed, it is refused with a reason.
    stale = attrs.evolve(batch[0], lease_id=UUID(int=0))
    results = coord.heartbeat_many([stale, *batch[1:]], ttl=LEASE_TTL)
    refused = [r.reason for r in results if not r.ok]
    _check(len(results) == BATCH and refused == [Reason.LEASE_REPLACED],
           f"batch with one stale lease: refused {refused}")
    notes.append(f"batch of {BATCH} with one stale lease: {BATCH - 1} renewed, 1 refused "
                 f"({refused[0]}), no exception")
    return found, notes


def run(store: PostgresLeaseStore, conn: psycopg.Connection[Any], tenant: str,
        counts: Counts, progress: Callable[[str], None], *,
        calls_only: bool = False) -> SingleResults:
    """Every comparison; with ``calls_only`` only validate and the four writes (the
    cross-core pass, which repeats them with the backend on another core)."""
    bench = Bench(store, conn, tenant)
    out = SingleResults()
    if not calls_only:
        progress("wire shapes (libpq trace)")
        out.shapes, out.notes = shapes(bench)
    progress("validate")
    out.comparisons["validate"] = interleave(
        validate_cases(bench), rounds=counts.validate_rounds,
        per_round=counts.validate_per_round, warmup=counts.warmup)
    for name, make in (("heartbeat", heartbeat_cases), ("acquire", acquire_cases),
                       ("takeover", takeover_cases), ("release", release_cases)):
        progress(name)
        out.comparisons[name] = interleave(
            make(bench), rounds=counts.write_rounds, per_round=counts.write_per_round,
            warmup=min(counts.warmup, counts.write_per_round))
    if calls_only:
        return out
    # The same heartbeat comparison with the commit flush taken out (this session only, in
    # the benchmark's throwaway database): what is left is the design's difference, one
    # round trip against five, which the flush otherwise hides on a slow disk.
    progress("heartbeat without the commit flush (synchronous_commit=off, this session)")
    conn.execute(b"SET synchronous_commit = off")
    try:
        out.comparisons["heartbeat_no_flush"] = interleave(
            heartbeat_cases(bench), rounds=counts.write_rounds,
            per_round=counts.write_per_round, warmup=min(counts.warmup, counts.write_per_round))
    finally:
        conn.execute(b"RESET synchronous_commit")
    progress("batched heartbeat")
    out.comparisons["batch"] = interleave(
        batch_cases(bench, counts), rounds=counts.write_rounds,
        per_round=counts.write_per_round, warmup=min(counts.warmup, counts.write_per_round))
    return out
