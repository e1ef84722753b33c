"""What the store's own Python costs a read: ``store.load`` against the statement it sends.

    python bench/store_overhead.py [--rounds N] [--per-round N] [--no-pin] [--cross-core]

Three cases on the store's dedicated connection, interleaved in rounds, client and backend
pinned to one core (or, with ``--cross-core``, each to a core of its own): the store's
``load`` (its fast path: entering the connection, the deadline watch, the call and its
parsing), the same prepared ``load.sql`` on the store's own long-lived cursor (``wire``),
and plain psycopg (``raw``: a cursor per call). No coordinator: this is the store's share of
a validate alone. Copy it into another checkout to measure that checkout's store the same
way (``bench/_path.py`` puts the checkout first).
"""

from __future__ import annotations

import argparse
import sys

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
from common import raw_load, run_raw, run_wire, server, store_wire, throwaway_database
from measure import Case, interleave, throughput_ratio
from pinning import pin

from mos_lease import LeaseIdentity
from mos_lease_pg import PostgresLeaseStore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/store_overhead.py")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=1000)
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--cross-core", action="store_true")
    args = parser.parse_args(argv)
    srv = server()
    try:
        with throwaway_database(srv, "mos_lease_bench_store") as dsn, \
                PostgresLeaseStore(dsn) as store:
            identity = LeaseIdentity("bench", "store", "b1")
            wire = store_wire(store)
            pinning = pin(wire.conn, cpu=None, enabled=not args.no_pin, cross=args.cross_core)
            print(pinning.note, file=sys.stderr)
            raw = raw_load(store, identity)

            def library(_i: int) -> None:
                store.load(identity)

            def wired(_i: int) -> None:
                run_wire(wire, raw)

            def plain(_i: int) -> None:
                run_raw(wire.conn, raw)

            try:
                series = interleave([Case("store.load", library), Case("wire", wired),
                                     Case("raw", plain)],
                                    rounds=args.rounds, per_round=args.per_round, warmup=500)
            finally:
                pinning.restore()
    finally:
        srv.stop()
    for name, s in series.items():
        print(f"{name:<11} {s.ops_per_s:>9,.0f}/s  p50 {s.p50_us:6.1f} µs  "
              f"{throughput_ratio(s, series['raw']):.3f}x raw  "
              f"{throughput_ratio(s, series['wire']):.3f}x wire")
    return 0


if __name__ == "__main__":
    sys.exit(main())
