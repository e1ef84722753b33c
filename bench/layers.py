"""Where one validate's time goes, layer by layer, pinned and cross-core.

``bench/run.py`` reports ``validate_vs_raw`` (the library's validate over plain psycopg
sending the same prepared ``load.sql``). This script takes the library's call apart, to show
which layer costs what on this machine and what a validate without each layer would reach.
Every case validates the same live grant on the store's own dedicated connection, in the
interleaved rounds of :mod:`measure`:

* ``library``: :meth:`mos_lease.ConnectorLeaseCoordinator.validate`.
* ``inline``: the same input checks and the same pure judging (:mod:`mos_lease.validation`)
  called one after the other, with the store's ``load``, but without the flow, its driver
  and the telemetry hook. A reference, not an alternative: it leaves out the fail-closed
  path of an unreadable store and a refusal's audit row, so it only handles this grant.
* ``inline_bare_store``: ``inline``, its row read by the statement's wire call and parse
  alone: no call bound (the watchdog that cancels a statement past its deadline), no
  coalescing of concurrent reads, no lock on the connection, no error translation or
  resend. What a validate would cost with none of the store's promises.
* ``store_load``: the store's ``load`` alone, as a validate calls it: its share of a validate.
* ``wire``: the statement on the store's long-lived binary cursor, its row not parsed.
* ``raw``: plain psycopg (``conn.execute(..., prepare=True).fetchall()``): the floor.

Each case's ratio to ``raw`` is the median of per-round ratios. Copy this file into another
checkout (with ``pinning.py``) to measure that checkout the same way (``bench/_path.py`` puts
the checkout first). Run::

    .venv/bin/python bench/layers.py [--rounds 15] [--per-round 1000]
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
import psycopg
import single
from common import (
    NO_OFFSET,
    SCOPES,
    BenchError,
    CorrectnessError,
    failed,
    raw_load,
    run_raw,
    run_wire,
    server,
    store_connection,
    throwaway_database,
)
from measure import Case, Series, interleave, throughput_ratio
from pinning import pin

from mos_lease import LeaseIdentity
from mos_lease.context import ConnectorExecutionContext
from mos_lease.grants import ExecutionGrant
from mos_lease.identity import check_correlation_id
from mos_lease.records import Snapshot
from mos_lease.results import ValidationResult
from mos_lease.validation import (
    Validate,
    context_expiry,
    read_refusal,
    validation_refusal_unread,
)
from mos_lease_pg import PostgresLeaseStore, statements

CASES = ("library", "inline", "inline_bare_store", "store_load", "wire", "raw")


def cases(bench: single.Bench) -> list[Case]:
    lease = bench.acquire("layers")
    holder = single._Grant(bench, lease)
    holder.refresh()
    coord, store, identity = bench.coord, bench.store, lease.identity
    flows = coord._flows
    monotonic = time.monotonic
    call = statements.load(identity, NO_OFFSET)
    load = raw_load(store, identity)

    def inline(grant: ExecutionGrant, read: Callable[[LeaseIdentity], Snapshot]
               ) -> ValidationResult:
        checked = flows.inputs.identity("identity", identity)
        requested = flows.inputs.scopes("scopes", SCOPES)
        check_correlation_id("correlation_id", None)
        command = Validate(checked, requested, grant.identity, grant.connector_id,
                           grant.lease_id, grant.epoch, grant.scopes, grant.expires_at,
                           flows.grants.check(grant), grant.correlation_id)
        if validation_refusal_unread(command) is not None:
            raise CorrectnessError("inline validate refused before reading")
        sent = monotonic()
        snapshot = read(command.granted_identity)
        in_flight = monotonic() - sent
        flows.grants.prune(snapshot.now)
        reason = read_refusal(command, snapshot, in_flight)
        if reason is not None or snapshot.row is None:
            raise CorrectnessError(f"inline validate refused: {reason}")
        return ValidationResult(None, ConnectorExecutionContext(
            identity=grant.identity, connector_id=grant.connector_id,
            lease_id=grant.lease_id, epoch=grant.epoch, scopes=requested,
            expires_at=context_expiry(command, snapshot.row),
            correlation_id=grant.correlation_id))

    def bare(_identity: LeaseIdentity) -> Snapshot:
        return call.parse(bench.wire.execute(call.statement.text, call.params))

    def grant() -> ExecutionGrant:
        assert holder.grant is not None
        return holder.grant

    def library(_i: int) -> None:
        if coord.validate(grant(), identity=identity, scopes=SCOPES).context is None:
            raise CorrectnessError("validate refused")

    def inlined(_i: int) -> None:
        inline(grant(), store.load)

    def inlined_bare(_i: int) -> None:
        inline(grant(), bare)

    def store_load(_i: int) -> None:
        store.load(identity)

    def wire(_i: int) -> None:
        run_wire(bench.wire, load)

    def raw(_i: int) -> None:
        run_raw(bench.conn, load)

    calls = (library, inlined, inlined_bare, store_load, wire, raw)
    return [Case(name, fn, setup=holder.refresh) for name, fn in zip(CASES, calls, strict=True)]


def one_pass(store: PostgresLeaseStore, conn: psycopg.Connection[Any], *, cross: bool,
             rounds: int, per_round: int) -> None:
    placement = pin(conn, cpu=None, enabled=True, cross=cross)
    try:
        print(placement.note, flush=True)
        if not placement.applied:
            raise BenchError("could not pin the client and its backend")
        bench = single.Bench(store, conn, f"bench-{secrets.token_hex(4)}")
        series = interleave(cases(bench), rounds=rounds, per_round=per_round, warmup=200)
    finally:
        placement.restore()
    report(series)


def report(series: dict[str, Series]) -> None:
    raw = series["raw"]
    print(f"  {'case':<18} {'p50 us':>8} {'ops/s':>9} {'vs raw':>7}")
    for name in CASES:
        s = series[name]
        print(f"  {name:<18} {s.p50_us:8.1f} {s.ops_per_s:9.0f} "
              f"{throughput_ratio(s, raw):7.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.per_round < 1:
        parser.error("--rounds and --per-round must be at least 1")
    srv = server()
    try:
        with throwaway_database(srv, "mos_lease_bench_layers") as dsn, \
                PostgresLeaseStore(dsn) as store:
            conn = store_connection(store)
            for cross in (False, True):
                print("cross-core" if cross else "pinned", flush=True)
                one_pass(store, conn, cross=cross, rounds=args.rounds,
                         per_round=args.per_round)
    except (BenchError, CorrectnessError) as error:
        return failed(error)
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
