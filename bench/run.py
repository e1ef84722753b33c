"""mos-lease benchmark: the library against floors measured in the same run.

    python bench/run.py [--quick] [--json PATH] [--check] [--cpu N] [--no-pin]
                        [--only stamps|single|peers|coalesce|requests|standby|turn|fleet]
                        [--redis URL]

Finds PostgreSQL exactly as the tests do (``MOS_LEASE_TEST_DSN``, then a trust-auth server on
127.0.0.1:5432, testcontainers, a throwaway initdb cluster), works in throwaway databases it
creates and drops, and prints ops/s, p50 and p99 of every case and the ratios of the library
to its floors. See bench/README.md for how to read them.

Exit status: 0 when the benchmark ran (figures are reported, not judged, unless --check);
1 with --check when a target was missed; 2 when it could not run (no server, bad
arguments); 3 when a correctness assertion failed (e.g. not exactly one winner in a round).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
import attrs
import audit_log
import coalesce
import contention
import event_ids
import fleet
import gateway_requests
import grant_memory
import keep_lines
import notices
import peers
import psycopg
import purecore
import scale
import single
import stamps
import standby
import supervisor
import telemetry
import turn_cost
from common import BenchError, CorrectnessError, server, store_connection, throwaway_database
from measure import Series, throughput_ratio
from pinning import Pinning, pin
from targets import FLEET_KEYS, JSON_KEYS, evaluate

import mos_lease
from mos_lease_pg import PostgresLeaseStore
from tests.pg_support import PgServer


@attrs.frozen
class Mode:
    name: str
    single: single.Counts
    contention_rounds: int
    contention_blocks: int
    scale_small: int
    scale_large: int
    scale_rounds: int
    scale_per_round: int
    core_decisions: int
    core_repeats: int
    memory_small: int
    memory_large: int
    notice_trials: int
    audit_rows: int
    audit_rounds: int
    audit_per_round: int
    supervisor: supervisor.Size
    peers: peers.PeerSize
    coalesce_rounds: int = 8
    coalesce_per_block: int = 960
    requests: gateway_requests.Size = attrs.field(factory=gateway_requests.Size)
    standby: tuple[int, float] = (10_000, 15.0)  # bindings, ttl (s)
    turn_notices: int = 200  # notice-triggered turns sampled at each size (bench/turn_cost.py)


FULL = Mode("full", single.FULL, contention_rounds=800, contention_blocks=8,
            scale_small=1_000, scale_large=1_000_000, scale_rounds=20, scale_per_round=1000,
            core_decisions=200_000, core_repeats=7, memory_small=10_000,
            memory_large=1_000_000, notice_trials=20, audit_rows=20_000_000, audit_rounds=20,
            audit_per_round=500, supervisor=supervisor.FULL_SIZE, peers=peers.FULL)
QUICK = Mode("quick", single.QUICK, contention_rounds=40, contention_blocks=4,
             scale_small=1_000, scale_large=20_000, scale_rounds=4, scale_per_round=200,
             core_decisions=20_000, core_repeats=3, memory_small=1_000, memory_large=20_000,
             notice_trials=5, audit_rows=20_000, audit_rounds=4, audit_per_round=100,
             supervisor=supervisor.QUICK_SIZE, peers=peers.QUICK, coalesce_rounds=2,
             coalesce_per_block=320, requests=gateway_requests.QUICK,
             standby=(1_000, 6.0), turn_notices=50)


@attrs.frozen
class Row:
    op: str
    case: str
    rate: float
    unit: str
    p50_us: float = math.nan
    p99_us: float = math.nan
    ratios: str = ""


@attrs.define
class Report:
    mode: Mode
    environment: list[str] = attrs.field(factory=list)
    rows: list[Row] = attrs.field(factory=list)
    figures: dict[str, float] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)
    shapes: list[str] = attrs.field(factory=list)
    partial: bool = False  # --only: the targets of the figures not measured are left out
    skipped: set[str] = attrs.field(factory=set)  # figures whose peer was absent (no Redis)

    def judged(self) -> list[tuple[Any, float, bool]]:
        return [(t, value, met) for t, value, met in evaluate(self.figures)
                if (not self.partial or t.figure in self.figures)
                and t.figure not in self.skipped]

    def series(self, op: str, case: str, s: Series, unit: str, ratios: str = "") -> None:
        self.rows.append(Row(op, case, s.ops_per_s, unit, s.p50_us, s.p99_us, ratios))


def _environment(srv: PgServer, conn: psycopg.Connection[Any], mode: Mode) -> list[str]:
    def show(name: str) -> str:
        row = conn.execute(f"SHOW {name}".encode()).fetchone()
        return "?" if row is None else str(row[0])

    return [
        f"mode {mode.name}; PostgreSQL {show('server_version')} via {srv.how} "
        f"(fsync={show('fsync')}, synchronous_commit={show('synchronous_commit')}, "
        f"shared_buffers={show('shared_buffers')})",
        f"Python {platform.python_version()}, psycopg {psycopg.__version__} "
        f"({psycopg.pq.__impl__}, libpq {psycopg.pq.version()}), {os.cpu_count()} CPUs, "
        f"load average at start {os.getloadavg()[0]:.2f}",
        f"library measured: {Path(mos_lease.__file__).resolve().parent.parent}",
    ]


def _ratio_text(value: float, name: str) -> str:
    return f"{value:.2f}x {name}"


def measure_all(srv: PgServer, mode: Mode, args: argparse.Namespace,
                progress: Callable[[str], None]) -> Report:
    report = Report(mode)
    tenant = f"bench-{secrets.token_hex(4)}"
    if args.only == "peers":
        return _peers_only(report, srv, tenant, args, progress)
    if args.only in ("coalesce", "requests", "standby", "turn", "fleet"):
        return _only_section(srv, report, tenant, args.only, progress)
    with throwaway_database(srv, "mos_lease_bench") as dsn:
        with PostgresLeaseStore(dsn) as store:
            conn = store_connection(store)
            report.environment = _environment(srv, conn, mode)
            pinning = pin(conn, cpu=args.cpu, enabled=not args.no_pin)
            report.environment.append(f"pinning: {pinning.note}")
            progress(pinning.note)
            try:
                stamped = (None if args.only == "single"
                           else _stamps(dsn, store, conn, tenant, mode, progress))
                if stamped is not None and args.only == "stamps":
                    _stamp_figures(report, stamped)
                    report.partial = True
                    return report
                one = single.run(store, conn, tenant, mode.single, progress)
                if args.only == "single":
                    _single_figures(report, one)
                    _cross_core_figures(report, _cross_core(store, conn, tenant, mode, args,
                                                            pinning, progress))
                    report.partial = True
                    return report
                progress("pure core")
                core = purecore.run(decisions=mode.core_decisions, repeats=mode.core_repeats)
                progress("telemetry: validate with and without the hook check (memory store)")
                hooked = telemetry.run(rounds=20 if mode is QUICK else 60,
                                       per_round=2000 if mode is QUICK else 5000,
                                       warmup=500 if mode is QUICK else 5000)
                with throwaway_database(srv, "mos_lease_bench_scale", migrated=False) as sdsn:
                    scaled = scale.run(sdsn, small=mode.scale_small, large=mode.scale_large,
                                       rounds=mode.scale_rounds,
                                       per_round=mode.scale_per_round, pinning=pinning,
                                       progress=progress)
                crossed = _cross_core(store, conn, tenant, mode, args, pinning, progress)
            finally:
                pinning.restore()
        with throwaway_database(srv, "mos_lease_bench_event_ids", migrated=False) as edsn:
            claimed = event_ids.run(edsn, tenant, rounds=mode.single.write_rounds,
                                    per_round=mode.single.write_per_round,
                                    batch_calls=mode.single.batch_calls_per_round,
                                    warmup=mode.single.warmup, cpu=args.cpu,
                                    pinned=not args.no_pin, progress=progress)
        progress(f"contention: {contention.PROCESSES} processes racing takeover (unpinned)")
        raced = contention.run(dsn, tenant, rounds=mode.contention_rounds,
                               blocks=mode.contention_blocks)
        progress(f"notices: takeover to on_lost, {mode.notice_trials} trials with and without")
        pushed = notices.run(dsn, tenant, trials=mode.notice_trials)
    audited = audit_log.run(srv, tenant, rows=mode.audit_rows, rounds=mode.audit_rounds,
                            per_round=mode.audit_per_round, progress=progress)
    progress(f"grant registry memory ({mode.memory_large:,} grants, fresh interpreter)")
    memory = grant_memory.run(small=mode.memory_small, large=mode.memory_large)
    _single_figures(report, one)
    _cross_core_figures(report, crossed)
    assert stamped is not None
    _stamp_figures(report, stamped)
    _other_figures(report, raced, scaled, core, memory)
    _telemetry_figures(report, hooked)
    _notice_figures(report, pushed)
    _audit_figures(report, audited)
    _event_id_figures(report, claimed)
    _last_sections(report, srv, tenant, mode, args, progress)
    return report


def _cross_core(store: PostgresLeaseStore, conn: psycopg.Connection[Any], tenant: str,
                mode: Mode, args: argparse.Namespace, pinning: Pinning,
                progress: Callable[[str], None]) -> single.SingleResults | None:
    """Validate and the four writes once more with the backend on another core than the
    client (``None`` when the pinned pass was not pinned: there is no placement to vary)."""
    if not pinning.applied:
        return None
    pinning.restore()  # this pass comes last: nothing after it runs pinned
    crossed = pin(conn, cpu=args.cpu, enabled=True, cross=True)
    progress(crossed.note)
    try:
        if not crossed.applied:
            return None
        # A tenant of its own: the pinned pass used up its identities.
        return single.run(store, conn, f"{tenant}-x", mode.single, progress, calls_only=True)
    finally:
        crossed.restore()


def _cross_core_figures(report: Report, crossed: single.SingleResults | None) -> None:
    """The cross-core pass's ratios, named ``<figure>_cross_core``."""
    if crossed is None:
        report.notes.append("cross-core pass: not run (the pinned pass could not pin)")
        return
    figures = report.figures
    v = crossed.comparisons["validate"]
    figures["validate_vs_raw_cross_core"] = throughput_ratio(v["library"], v["raw"])
    report.series("cross-core", "library validate()", v["library"], "ops/s",
                  _ratio_text(figures["validate_vs_raw_cross_core"], "raw"))
    report.series("cross-core", "raw load.sql", v["raw"], "ops/s")
    for op in ("heartbeat", "acquire", "takeover", "release"):
        c = crossed.comparisons[op]
        floor = "raw_read_cas" if op == "takeover" else "raw"
        figures[f"{op}_vs_raw_cross_core"] = throughput_ratio(c["library"], c[floor])
        report.series("cross-core", f"library {op}()", c["library"], "ops/s",
                      _ratio_text(figures[f"{op}_vs_raw_cross_core"], floor.replace("_", " ")))
    c = crossed.comparisons["takeover"]
    figures["takeover_observed_vs_raw_cross_core"] = throughput_ratio(c["observed"], c["raw"])


def _stamps(dsn: str, store: PostgresLeaseStore, conn: psycopg.Connection[Any], tenant: str,
            mode: Mode, progress: Callable[[str], None]) -> stamps.StampResult:
    counts = mode.single
    # Twice the rounds of the other write comparisons: the difference sought is a few µs,
    # and the median over more rounds holds still on a shared machine.
    return stamps.run(dsn, store, conn, tenant, rounds=2 * counts.write_rounds,
                      per_round=counts.write_per_round,
                      batch_calls=counts.batch_calls_per_round,
                      warmup=min(counts.warmup, counts.write_per_round), progress=progress)


def _stamp_figures(report: Report, stamped: stamps.StampResult) -> None:
    figures = report.figures
    for suffix, s, b in (("", stamped.single, stamped.batch),
                         ("_no_flush", stamped.single_no_flush, stamped.batch_no_flush)):
        op = "no flush" if suffix else "stamps"
        checks = figures[f"heartbeat_stamp_checks_vs_before{suffix}"] = throughput_ratio(
            s["now"], s["before"])
        guard = figures[f"heartbeat_stamp_guard_vs_before{suffix}"] = throughput_ratio(
            s["guard only"], s["before"])
        batch = figures[f"batch_stamp_checks_vs_before{suffix}"] = throughput_ratio(
            b["now"], b["before"])
        report.series(op, "heartbeat, guard + trigger", s["now"], "ops/s",
                      _ratio_text(checks, "before"))
        report.series(op, "heartbeat, guard only", s["guard only"], "ops/s",
                      _ratio_text(guard, "before"))
        report.series(op, "heartbeat, before (floor)", s["before"], "ops/s")
        report.series(op, f"batch of {stamps.BATCH}, guard + trigger", b["now"], "leases/s",
                      _ratio_text(batch, "before"))
        report.series(op, f"batch of {stamps.BATCH}, before", b["before"], "leases/s")
        per_write_us = statistics.median(
            (1e6 / s["now"].round_rate(k)) - (1e6 / s["before"].round_rate(k))
            for k in range(min(len(s["now"].block_ns), len(s["before"].block_ns))))
        report.notes.append(
            f"stamp checks{' without the commit flush' if suffix else ''}: {per_write_us:+.1f} "
            f"µs per heartbeat (median over rounds of the per-round difference in mean time "
            f"per call, guard + trigger against the statement and schema before them)")


def _single_figures(report: Report, one: single.SingleResults) -> None:
    figures = report.figures
    v = one.comparisons["validate"]
    figures["validate_vs_raw"] = throughput_ratio(v["library"], v["raw"])
    figures["validate_vs_select1"] = throughput_ratio(v["library"], v["select1"])
    figures["validate_p99_vs_raw"] = v["library"].p99_us / v["raw"].p99_us
    figures["validate_vs_wire"] = throughput_ratio(v["library"], v["wire"])
    report.series("validate", "library validate()", v["library"], "ops/s",
                  f"{_ratio_text(figures['validate_vs_raw'], 'raw')}, "
                  f"{_ratio_text(figures['validate_vs_wire'], 'wire')}, "
                  f"{_ratio_text(figures['validate_vs_select1'], 'SELECT 1')}")
    report.series("validate", "raw load.sql", v["raw"], "ops/s")
    report.series("validate", "wire load.sql", v["wire"], "ops/s")
    report.series("validate", "raw SELECT 1", v["select1"], "ops/s")
    for op in ("heartbeat", "acquire", "takeover", "release"):
        c = one.comparisons[op]
        # A takeover tells its policy the lease's state, so its honest floor is the raw
        # read plus the raw compare-and-set; the others' is their one raw statement.
        floor = "raw_read_cas" if op == "takeover" else "raw"
        figures[f"{op}_vs_raw"] = throughput_ratio(c["library"], c[floor])
        figures[f"{op}_vs_naive"] = throughput_ratio(c["library"], c["naive"])
        figures[f"{op}_vs_wire"] = throughput_ratio(c["library"], c["wire"])
        report.series(op, f"library {op}()", c["library"], "ops/s",
                      f"{_ratio_text(figures[f'{op}_vs_raw'], floor.replace('_', ' '))}, "
                      f"{_ratio_text(figures[f'{op}_vs_wire'], 'wire')}, "
                      f"{_ratio_text(figures[f'{op}_vs_naive'], 'naive')}")
        report.series(op, "raw statement", c["raw"], "ops/s")
        report.series(op, "wire statement", c["wire"], "ops/s")
        report.series(op, "naive 5 round trips", c["naive"], "ops/s")
    # Given the view its coordinator returned, a takeover is one round trip, judged against
    # the compare-and-set alone.
    c = one.comparisons["takeover"]
    figures["takeover_vs_cas"] = throughput_ratio(c["library"], c["raw"])
    figures["takeover_observed_vs_raw"] = throughput_ratio(c["observed"], c["raw"])
    report.series("takeover", "library takeover(observed=view)", c["observed"], "ops/s",
                  _ratio_text(figures["takeover_observed_vs_raw"], "raw"))
    report.series("takeover", "raw read + statement", c["raw_read_cas"], "ops/s")
    c = one.comparisons["heartbeat_no_flush"]
    figures["heartbeat_vs_naive_no_flush"] = throughput_ratio(c["library"], c["naive"])
    figures["heartbeat_vs_raw_no_flush"] = throughput_ratio(c["library"], c["raw"])
    report.series("no flush", "library heartbeat()", c["library"], "ops/s",
                  f"{_ratio_text(figures['heartbeat_vs_raw_no_flush'], 'raw')}, "
                  f"{_ratio_text(figures['heartbeat_vs_naive_no_flush'], 'naive')}")
    report.series("no flush", "raw statement", c["raw"], "ops/s")
    report.series("no flush", "naive 5 round trips", c["naive"], "ops/s")
    b = one.comparisons["batch"]
    figures["batch_heartbeat_vs_single"] = throughput_ratio(b["batch"], b["single"])
    report.series("batch", f"heartbeat_many({single.BATCH})", b["batch"], "leases/s",
                  _ratio_text(figures["batch_heartbeat_vs_single"], "single"))
    report.series("batch", "heartbeat() one by one", b["single"], "leases/s")

    for name, shape in one.shapes.items():
        figures[f"{name}_round_trips"] = shape.round_trips
        figures[f"{name}_transactions"] = shape.transactions
        figures[f"{name}_parses"] = shape.parses
        report.shapes.append(f"{name:<20} {shape}")
    report.notes.extend(one.notes)


def _other_figures(report: Report, raced: contention.ContentionResult,
                   scaled: scale.ScaleResult, core: purecore.CoreResult,
                   memory: grant_memory.MemoryResult) -> None:
    figures = report.figures
    figures["contention_vs_raw"] = raced.ratio
    report.rows.append(Row("contention", f"library race, {contention.PROCESSES} procs",
                           raced.library_rounds_per_s, "rounds/s",
                           ratios=_ratio_text(raced.ratio, "raw race")))
    report.rows.append(Row("contention", "raw CAS race", raced.raw_rounds_per_s, "rounds/s"))
    report.notes.append(
        f"contention: exactly one winner in each of {raced.rounds['library']} library and "
        f"{raced.rounds['raw']} raw timed rounds (and warm-up rounds); library losers' "
        f"refusals: {raced.refusals}; epochs and audit rows checked")

    figures["scale_p50_1m_vs_1k"] = scaled.ratio
    for side, rows in (("small", scaled.small), ("large", scaled.large)):
        s = scaled.series[side]
        extra = _ratio_text(scaled.ratio, "p50 of small") if side == "large" else ""
        report.series("scale", f"validate, {rows:,} rows", s, "ops/s", extra)
    report.notes.append(f"scale: {scaled.small:,} and {scaled.large:,} rows loaded and vacuumed "
                        f"in {scaled.load_seconds:.1f} s")

    figures["core_decisions_per_s"] = core.decisions_per_s
    report.rows.append(Row("core", f"decide(), mix of {core.mix}", core.decisions_per_s,
                           "decisions/s", ratios=f"best repeat {core.best_per_s:,.0f}/s"))

    figures["grant_registry_rss_growth_mib"] = memory.growth_mib
    report.notes.append(
        f"memory: RSS {memory.rss_small_mib:.1f} MiB after {memory.small:,} grants minted and "
        f"expired, {memory.rss_large_mib:.1f} MiB after {memory.large:,} "
        f"(growth {memory.growth_mib:+.2f} MiB); live grants left: {memory.live_after}")


def _turn_cost(mode: Mode, progress: Callable[[str], None]) -> turn_cost.TurnCostResult:
    progress("supervisor turn: CPU of a notice-triggered turn at 1,000 and 10,000 bindings "
             "(in-memory store)")
    return turn_cost.run(notices=mode.turn_notices)


def _turn_figures(report: Report, turned: turn_cost.TurnCostResult) -> None:
    report.figures["turn_cpu_10k_vs_1k"] = turned.ratio
    counted = keep_lines.run()
    report.figures["keep_lines"] = counted.total
    report.notes.append("keep engine: " + ", ".join(
        f"{part} {lines:,}" for part, lines in counted.per_part.items())
        + f"; {counted.total:,} lines in all")
    report.rows.append(Row("turn", f"notice-triggered, {turned.small:,} bindings",
                           1e3 / turned.small_ms, "turns/CPU-s"))
    report.rows.append(Row("turn", f"notice-triggered, {turned.large:,} bindings",
                           1e3 / turned.large_ms, "turns/CPU-s",
                           ratios=f"{turned.ratio:.2f}x the CPU at {turned.small:,}"))
    report.notes.append(
        f"supervisor turn: median CPU of a notice-triggered turn (one binding's read, then "
        f"the turn that sleeps), {turned.notices} notices at each size: "
        f"{turned.small_ms:.3f} ms at {turned.small:,} bindings, {turned.large_ms:.3f} ms at "
        f"{turned.large:,}")


def _telemetry_figures(report: Report, hooked: telemetry.TelemetryResult) -> None:
    report.figures["telemetry_overhead_validate"] = hooked.ratio
    s = hooked.series
    report.series("telemetry", "validate, check, no hook", s[telemetry.NONE_ATTACHED],
                  "ops/s", _ratio_text(hooked.ratio, "no check"))
    report.series("telemetry", "validate, no check (floor)", s[telemetry.NO_HOOK_PATH], "ops/s")
    report.series("telemetry", "validate, no-op hook", s[telemetry.ATTACHED],
                  "ops/s", _ratio_text(hooked.attached_ratio, "no check"))
    report.series("telemetry", "validate, hand-written loop", s[telemetry.HAND_LOOP],
                  "ops/s", f"floor {_ratio_text(hooked.hand_ratio, 'hand loop')}")


def _notice_figures(report: Report, pushed: notices.NoticeResult) -> None:
    report.figures["notice_to_lost_p50_ms"] = pushed.with_p50_ms
    report.figures["notice_to_lost_without_p50_ms"] = pushed.without_p50_ms
    report.notes.append(
        f"notices: takeover commit to the old holder's on_lost, p50 over "
        f"{len(pushed.with_ms)} trials: {pushed.with_p50_ms:.2f} ms with notices "
        f"(max {max(pushed.with_ms):.2f}), {pushed.without_p50_ms:.0f} ms without (TTL "
        f"{notices.TTL:g} s); SELECT 1 round trip p50 {pushed.floor_ms:.3f} ms, so with "
        f"notices {pushed.with_p50_ms / pushed.floor_ms:.1f}x the floor")


def _audit_figures(report: Report, audited: audit_log.AuditLogResult) -> None:
    report.figures["audit_insert_20m_vs_empty"] = audited.ratio
    report.figures["audit_archive_rows_per_s"] = audited.archive_rows_per_s
    report.series("audit log", f"heartbeat, {audited.rows:,} rows", audited.filled, "ops/s",
                  _ratio_text(audited.ratio, "empty log"))
    report.series("audit log", "heartbeat, empty log", audited.empty, "ops/s")
    per_day_gb = audited.rows_per_day * audited.bytes_per_row / 1e9
    report.notes.append(
        f"audit log: {audit_log.CONNECTORS:,} connectors heartbeating every "
        f"{audit_log.HEARTBEAT_S} s append {audited.rows_per_day:,} rows/day; at "
        f"{audited.bytes_per_row:.0f} bytes/row (table and indexes, measured) about "
        f"{per_day_gb:.1f} GB/day")
    report.notes.append(
        f"audit log: {audited.rows:,} rows filled over {audited.partitions} partitions in "
        f"{audited.fill_s:.1f} s ({audited.rows / audited.fill_s:,.0f} rows/s, one INSERT ... "
        f"SELECT generate_series)")
    report.notes.append(
        f"audit log: archive of the oldest month ({audited.archived_rows:,} rows, "
        f"{audited.archived_bytes / 1e6:.1f} MB of JSON Lines; export, verify, drop) in "
        f"{audited.archive_s:.1f} s: {audited.archive_rows_per_s:,.0f} rows/s, "
        f"{audited.archive_mb_per_s:.1f} MB/s")


def _event_id_figures(report: Report, claimed: event_ids.EventIdResult) -> None:
    figures = report.figures
    figures["event_ids_heartbeat_vs_v3"] = claimed.heartbeat_ratio
    figures["event_ids_heartbeat_many_vs_v3"] = claimed.batch_ratio
    figures["event_ids_no_flush_vs_v3"] = claimed.no_flush_ratio
    for label, series, ratio, unit in (
            ("heartbeat", claimed.single, claimed.heartbeat_ratio, "ops/s"),
            (f"batch of {event_ids.BATCH}", claimed.batch, claimed.batch_ratio, "leases/s"),
            ("no flush", claimed.no_flush, claimed.no_flush_ratio, "ops/s")):
        report.series("event ids", f"{label}, today", series[event_ids.NEW], unit,
                      _ratio_text(ratio, "schema 3"))
        report.series("event ids", f"{label}, schema 3", series[event_ids.OLD], unit)
    report.notes.append(
        "event ids: the raw heartbeat statement with migration 0004 (each audit row claims its "
        "event id in connector_lease_event_ids, stamp check) against the same statement on a "
        "schema at version 3, interleaved on one connection")


def _peers_only(report: Report, srv: PgServer, tenant: str, args: argparse.Namespace,
                progress: Callable[[str], None]) -> Report:
    """``--only peers``: the supervisor and its peers, nothing else."""
    report.environment = [f"mode {report.mode.name}; PostgreSQL via {srv.how}",
                          f"{os.cpu_count()} CPUs, load average at start "
                          f"{os.getloadavg()[0]:.2f}"]
    _many_figures(report, *_many_bindings(srv, tenant, report.mode, args, progress))
    report.environment.append(f"load average at end {os.getloadavg()[0]:.2f}")
    report.partial = True
    return report


def _coalesce(dsn: str, tenant: str, mode: Mode,
              progress: Callable[[str], None]) -> coalesce.CoalesceResult:
    progress("coalesced validation: 1, 8 and 32 concurrent callers, tasks and threads "
             "(unpinned)")
    return coalesce.run(dsn, tenant, rounds=mode.coalesce_rounds,
                        per_block=mode.coalesce_per_block, progress=progress)


def _fleet_figures(report: Report, progress: Callable[[str], None]) -> None:
    """A fleet of real member processes over 10,000 bindings (bench/fleet.py): balance,
    a join, SIGTERM, SIGKILL and idle round trips, all read from the audit log, which must
    show one takeover per moved binding at epoch +1 and no preemption asked."""
    progress("fleet: three member processes over 10,000 bindings")
    figures = fleet.run(fleet.BINDINGS)
    report.figures.update({key: float(value) for key, value in figures.items()
                           if key in FLEET_KEYS and value is not None})
    report.notes.append(f"fleet: shares after 3 x ttl {figures['balance_shares']}; join "
                        f"from the new process's start, p99 "
                        f"{figures['fleet_join_from_start_p99_s']:.2f} s; WARNING lines "
                        f"{figures['fleet_warnings']}; hand-offs of one binding between "
                        f"two processes: p50 {figures['handover_ms_p50']:.1f} ms, p99 "
                        f"{figures['handover_ms_p99']:.1f} ms over {figures['handovers']}")


def _only_section(srv: PgServer, report: Report, tenant: str, only: str,
                  progress: Callable[[str], None]) -> Report:
    """``--only coalesce``, ``requests``, ``standby``, ``turn`` or ``fleet``: that section
    alone."""
    if only == "coalesce":
        with throwaway_database(srv, "mos_lease_bench_coalesce") as dsn:
            _coalesce_figures(report, _coalesce(dsn, tenant, report.mode, progress))
    elif only == "requests":
        _requests_figures(report, _requests(report.mode, progress))
    elif only == "turn":
        _turn_figures(report, _turn_cost(report.mode, progress))
    elif only == "fleet":
        _fleet_figures(report, progress)
    else:
        _standby_figures(report, srv, report.mode, progress)
    report.partial = True
    return report


def _last_sections(report: Report, srv: PgServer, tenant: str, mode: Mode,
                   args: argparse.Namespace, progress: Callable[[str], None]) -> None:
    """A supervisor turn's CPU (no database), coalesced validation, a gateway's requests end
    to end, then the supervisor and its peers, each in a database of its own, and the load
    average at the end of the run."""
    _turn_figures(report, _turn_cost(mode, progress))
    with throwaway_database(srv, "mos_lease_bench_coalesce") as dsn:
        _coalesce_figures(report, _coalesce(dsn, f"{tenant}-c", mode, progress))
    _requests_figures(report, _requests(mode, progress))
    _standby_figures(report, srv, mode, progress)
    _many_figures(report, *_many_bindings(srv, tenant, mode, args, progress))
    _fleet_figures(report, progress)
    report.environment.append(f"load average at end {os.getloadavg()[0]:.2f}")


def _requests(mode: Mode, progress: Callable[[str], None]
              ) -> gateway_requests.RequestsResult:
    size = mode.requests
    progress(f"requests: the ASGI gateway recipe ({size.bindings:,} bindings held) against a "
             f"plain app, {size.clients} keep-alive clients, real uvicorn processes")
    return gateway_requests.run(size, progress)


def _standby_figures(report: Report, srv: PgServer, mode: Mode,
                     progress: Callable[[str], None]) -> None:
    bindings, ttl = mode.standby
    progress(f"standby: two supervisor processes over {bindings:,} bindings (ttl {ttl:g} s): "
             "first acquire, a standby's reads, takeover after a kill, close")
    with throwaway_database(srv, "mos_lease_bench_standby") as dsn:
        figures = standby.run(dsn, bindings, ttl)
    report.figures.update(figures)
    if bindings != 10_000:
        report.notes.append(f"standby: the _10k figures measured at {bindings:,} bindings")


def _requests_figures(report: Report, result: gateway_requests.RequestsResult) -> None:
    report.figures.update(result.figures())
    for name in result.blocks:
        report.rows.append(Row("requests", name, result.rate(name), "req/s",
                               result.percentile(name, 0.5) * 1000,
                               result.percentile(name, 0.99) * 1000))
    report.notes.append(
        "requests: gateway_requests_vs_plain_app = the recipe (grant, then validate) over a "
        "plain app (read, audit row, commit); gateway_effect_requests_vs_plain_app = both "
        f"with an effect row (the recipe's a fenced effect, coalesced); {result.effects_checked} "
        "effect rows checked, one per 200")


def _many_bindings(srv: PgServer, tenant: str, mode: Mode, args: argparse.Namespace,
                   progress: Callable[[str], None]) -> tuple[supervisor.Summary,
                                                             peers.PeerResult]:
    """The supervisor holding many bindings (threads, then asyncio), then its peers, in a
    database of their own; the peers' renewal ratio uses this run's supervisor figure."""
    size = mode.supervisor
    with throwaway_database(srv, "mos_lease_bench_many") as dsn:
        progress(f"supervisor: {size.bindings:,} bindings, a Supervisor then an "
                 f"AsyncSupervisor, {size.rounds} renewal ticks each (ttl {size.ttl:g} s)")
        held = supervisor.run(dsn, size)
        progress("peers: redis-py Lock, PostgreSQL advisory locks and validate, "
                 f"{' and '.join(map(str, peers.CALLERS))} callers")
        beside = peers.run(dsn, f"{tenant}-peers", mode.peers, held.leases_per_s, args.redis,
                           progress, size.bindings)
    return held, beside


def _many_figures(report: Report, held: supervisor.Summary, beside: peers.PeerResult) -> None:
    figures = report.figures
    n = held.bindings
    size = "" if n == 10_000 else f" (measured at {n:,} bindings)"
    figures["supervisor_threads_10k"] = held.peak
    figures["supervisor_renewal_round_trips_10k"] = held.round_trips
    figures["supervisor_leases_per_s"] = held.leases_per_s
    figures["supervisor_leases_vs_single"] = held.ratio
    report.rows.append(Row("supervisor", f"renewal tick, {n:,} leases", held.leases_per_s,
                           "leases/s", ratios=_ratio_text(held.ratio, "single heartbeats")))
    report.rows.append(Row("supervisor", "heartbeat() one by one", held.singles_per_s,
                           "leases/s"))
    for one in held.per_kind:
        unit = "threads" if one.kind == "sync" else "tasks"
        trips = ", ".join(f"{t.round_trips} ({t.leases:,} leases)" for t in one.ticks)
        report.notes.append(
            f"supervisor ({one.kind}): {n:,} bindings held in {one.acquire_seconds:.1f} s; "
            f"{unit} of the library at once, at most {one.peak}"
            + (f" ({', '.join(one.names)})" if one.names else "")
            + f"; round trips per renewal tick: {trips}; median "
            f"{statistics.median(one.ratios()):.1f}x single heartbeats, "
            f"{statistics.median(one.overhead()):.2f}x heartbeat_many called directly; "
            f"no binding lost{size}")

    for key in beside.rates:
        side, op, callers, kind = key.split(":")
        count = f"{int(callers):,} leases," if op == "renew" else callers
        report.rows.append(Row("peers", f"{peers.SHORT[side, op]}, {count} {kind}",
                               beside.median(key),
                               "leases/s" if op == "renew" else "ops/s"))
    report.rows.append(Row("peers", "supervisor renewals", beside.supervisor_leases_per_s,
                           "leases/s"))
    if beside.redis_skipped is not None:
        report.notes.append(f"peers: {beside.redis_skipped}")
        report.skipped |= {"renewal_vs_redis_extend", "validate_vs_redis_check"}
    else:
        assert beside.renewal_vs_redis_extend is not None
        assert beside.validate_vs_redis_check is not None
        figures["renewal_vs_redis_extend"] = beside.renewal_vs_redis_extend
        figures["validate_vs_redis_check"] = beside.validate_vs_redis_check
        by_kind = ", ".join(f"{k} {v:.2f}" for k, v in beside.validate_by_kind.items())
        report.notes.append(
            "peers: renewal_vs_redis_extend = the slower supervisor's renewal ticks (leases/s, "
            f"{held.bindings:,} leases, in the peers' rounds) over the fastest redis-py "
            "Lock.extend of the same round (1 or 32 callers, threads or tasks), median of "
            "per-round ratios; "
            f"validate_vs_redis_check = validate over Lock.owned at {max(peers.CALLERS)} "
            f"callers, the faster kind of each side (same kind: {by_kind})")
    report.notes.append("peers: what each side guarantees")
    for side, durability, fencing, audit in beside.guarantees:
        report.notes.append(f"  {side}: durability {durability}; fencing token {fencing}; "
                            f"audit {audit}")
def _coalesce_figures(report: Report, result: coalesce.CoalesceResult) -> None:
    figures = result.figures()
    report.figures.update(figures)
    for op, flavour, what, suffix, unit in (
            ("validate", result.tasks, "validate", "", "val/s"),
            ("val thread", result.threads, "validate", "_threads", "val/s"),
            ("grant", result.grants, "grant", "", "grants/s")):
        if flavour is None:
            continue
        for case, callers, coalesced in coalesce.cases():
            ratios = ""
            if coalesced and callers > 1:
                single_ratio = figures[f"coalesced_{what}_{callers}_vs_single{suffix}"]
                before_ratio = figures[f"coalesced_{what}_{callers}_vs_uncoalesced{suffix}"]
                ratios = (f"{_ratio_text(single_ratio, '1 caller')}, "
                          f"{_ratio_text(before_ratio, 'uncoalesced')}")
            report.rows.append(Row(op, f"{case} callers", flavour.rate(case), unit,
                                   ratios=ratios))
    report.notes.append(
        "coalesced validation (unpinned): N callers on one store, asyncio tasks on one "
        "AsyncConnectorLeaseCoordinator ('validate'), threads on one "
        "ConnectorLeaseCoordinator ('val thread'); 'before' rows: each load its own round "
        "trip, as before coalescing")


def _num(value: float, digits: int = 0) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def render(report: Report) -> str:
    out = ["mos-lease benchmark", *(f"  {line}" for line in report.environment), ""]
    case = max([28, *(len(row.case) for row in report.rows)])
    header = f"{'operation':<11} {'case':<{case}} {'rate':>12} {'unit':<10} {'p50 µs':>8} " \
             f"{'p99 µs':>8}  ratios (same run)"
    out += [header, "-" * len(header)]
    last = ""
    for row in report.rows:
        out.append(f"{row.op if row.op != last else '':<11} {row.case:<{case}} "
                   f"{_num(row.rate):>12} {row.unit:<10} {_num(row.p50_us, 1):>8} "
                   f"{_num(row.p99_us, 1):>8}  {row.ratios}")
        last = row.op
    out += ["", "wire shapes (libpq trace of one warm call):",
            *(f"  {line}" for line in report.shapes)]
    out += ["", "checks and notes:", *(f"  {line}" for line in report.notes)]
    judged = report.judged()
    width = max([32, *(len(t.figure) for t, _, _ in judged)])
    out += ["", f"{'figure':<{width}} {'value':>14}  {'target':<10} met"]
    for target, value, met in judged:
        shown = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3f}"
        out.append(f"{target.figure:<{width}} {shown:>14}  {target!s:<10} "
                   f"{'yes' if met else 'NO'}")
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/run.py", description="mos-lease benchmark: ratios to same-run floors")
    parser.add_argument("--quick", action="store_true",
                        help="tiny counts: checks the benchmark works (< 60 s), not figures")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="write the named figures as one flat JSON object")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if any target is missed")
    parser.add_argument("--cpu", type=int, default=None,
                        help="core to pin client and backend to (default: the lowest allowed)")
    parser.add_argument("--no-pin", action="store_true",
                        help="do not pin the single-connection comparisons to one core")
    parser.add_argument("--only", choices=["stamps", "single", "peers", "coalesce", "requests",
                                           "standby", "turn", "fleet"],
                        default=None,
                        help="run one comparison only (stamps: what the stamp checks cost "
                        "per write; single: validate and the writes, pinned and "
                        "cross-core; peers: the supervisor holding many bindings, then "
                        "redis-py's Lock and PostgreSQL advisory locks beside it; coalesce: "
                        "validations at 1, 8 and 32 concurrent callers; turn: the CPU of a "
                        "notice-triggered supervisor turn at 1,000 and 10,000 bindings; fleet: "
                        "three member processes over 10,000 bindings), at the mode's counts")
    parser.add_argument("--redis", default=os.environ.get("MOS_LEASE_BENCH_REDIS",
                                                          peers.DEFAULT_REDIS),
                        help="the Redis the peers section measures (skipped when none "
                        "answers; default $MOS_LEASE_BENCH_REDIS or %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = QUICK if args.quick else FULL
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    try:
        srv = server()
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    progress(f"PostgreSQL via {srv.how}")
    try:
        report = measure_all(srv, mode, args, progress)
    except CorrectnessError as exc:
        print(f"bench: CORRECTNESS FAILURE: {exc}", file=sys.stderr)
        return 3
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    finally:
        srv.stop()
    print(render(report))
    print(f"\n(ran in {time.monotonic() - started:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps({key: report.figures[key] for key in JSON_KEYS
                                         if key in report.figures},
                                        indent=2) + "\n", encoding="utf-8")
    if args.check:
        missed = [t.figure for t, _, met in report.judged() if not met]
        if missed:
            print(f"bench: targets missed: {', '.join(missed)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
