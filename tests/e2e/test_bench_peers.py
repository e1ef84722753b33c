"""The benchmark's many-bindings and peers section (bench/supervisor.py, bench/peers.py, and
their part of bench/run.py), without a server: a Redis that does not answer is a skip line
and leaves its two ratios unjudged, a caller's failure ends the measurement, and each
figure is the worse of the two supervisors."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench(name: str) -> ModuleType:
    # The benchmark's modules import each other by plain name, from bench/.
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


peers = _bench("peers")
supervisor = _bench("supervisor")
run = _bench("run")
common = _bench("common")

PG_LINE = "fsync=on, synchronous_commit=on: every write flushed to disk at its commit"


def _figures(kind: str, peak: int, ticks: list[tuple[int, int, float]],
             singles: list[float]) -> Any:
    return supervisor.Figures(kind, 10_000, 1.0, peak, [],
                              [supervisor.Tick(*t) for t in ticks], singles,
                              [10_000.0] * len(ticks), 0, 1.0)


def _summary() -> Any:  # the benchmark's modules are imported at run time
    return supervisor.summarize([
        _figures("sync", 3, [(10, 10_000, 1.0), (11, 10_000, 2.0)], [500.0, 500.0]),
        _figures("async", 2, [(9, 9_000, 1.0), (10, 10_000, 1.0)], [1_000.0, 1_000.0]),
    ])


def _skipped_peers() -> Any:
    line = peers.redis_absent("redis://127.0.0.1:1/0")
    return peers.PeerResult({"ours:validate:32:tasks": [3_000.0, 3_100.0]},
                            {"ours:validate:32:tasks": "validate()"}, line,
                            peers.guarantees(None, PG_LINE), 7_000.0, None, None, {})


def test_a_redis_that_does_not_answer_is_a_skip_line() -> None:
    line = peers.redis_absent("redis://127.0.0.1:1/0")
    assert line is not None
    assert line.startswith("skipped: no Redis")
    assert "redis://127.0.0.1:1/0" in line


def test_without_redis_py_the_peers_are_a_skip_line_too(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "redis" else real(name, *a))
    line = peers.redis_absent("redis://127.0.0.1:6379/0")
    assert line is not None and line.startswith("skipped: no Redis client for ")
    assert "redis-py is not installed" in line


def test_without_redis_its_ratios_are_left_out_and_not_judged() -> None:
    report = run.Report(run.QUICK)
    run._many_figures(report, _summary(), _skipped_peers())
    assert "renewal_vs_redis_extend" not in report.figures
    assert "validate_vs_redis_check" not in report.figures
    judged = {t.figure: met for t, _value, met in report.judged()}
    assert "renewal_vs_redis_extend" not in judged
    assert "validate_vs_redis_check" not in judged
    assert judged["supervisor_threads_10k"] is True
    assert any(note.startswith("peers: skipped: no Redis on") for note in report.notes)
    # Only an absent peer is excused: a figure merely missing is judged, and missed.
    report.skipped.clear()
    judged = {t.figure: met for t, _value, met in report.judged()}
    assert judged["renewal_vs_redis_extend"] is False


def test_each_supervisor_figure_is_the_worse_of_the_two() -> None:
    summary = _summary()
    assert summary.peak == 3
    assert summary.round_trips == 11  # the most in any tick, whatever it renewed
    assert summary.full_ticks == 3
    # Per-round ratios: sync 10,000/500 = 20 and 5,000/500 = 10 (median 15); asyncio
    # 9,000/1,000 = 9 and 10,000/1,000 = 10 (median 9.5): the lower is reported.
    assert summary.ratio == pytest.approx(9.5)
    assert summary.leases_per_s == pytest.approx(7_500.0)  # sync's median tick, the slower


def test_a_caller_that_fails_ends_the_measurement_with_its_error() -> None:
    calls = 0
    lock = threading.Lock()

    def counted() -> None:
        nonlocal calls
        with lock:
            calls += 1

    def refused() -> None:
        peers.require(False, "a live grant was refused")

    count, elapsed = peers.drive_threads([counted, counted], 0.05)
    assert count == calls > 0 and elapsed >= 0.05
    with pytest.raises(common.CorrectnessError, match="a live grant was refused"):
        peers.drive_threads([counted, refused], 0.05)


def test_the_report_names_both_ratios_their_targets_and_the_guarantees() -> None:
    keys = {f"{side}:{op}:32:tasks": [1_000.0] for side, op in
            (("redis", "extend"), ("redis", "check"), ("ours", "validate"))}
    result = peers.PeerResult(keys, dict.fromkeys(keys, "case"), None,
                              peers.guarantees("none: nothing on disk", PG_LINE),
                              2_000.0, 2.0, 0.5, {"tasks": 0.5})
    text = "\n".join(peers.report(result))
    assert "renewal_vs_redis_extend: 2.00" in text and "target >= 1.5" in text
    assert "validate_vs_redis_check: 0.50 at 32 callers" in text and "target >= 1" in text
    assert "redis-py Lock (this Redis)  durability: none: nothing on disk" in text
    assert text.count("fencing token:") == 3
