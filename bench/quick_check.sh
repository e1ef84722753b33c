#!/usr/bin/env bash
# CI smoke test of the benchmark: runs `bench/run.py --quick` against PostgreSQL (found as
# the tests find it) and checks that the JSON it writes holds all 30 named figures as finite
# numbers, and the two peer ratios too where Redis answered (the run says when it did not). It checks that the benchmark works, not what it measured: figures from a shared
# CI machine are noise, so no target is judged here (that is `bench/run.py --check`).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

"$python" "$repo/bench/run.py" --quick --json "$out/figures.json"

"$python" - "$out/figures.json" <<'PY'
import json
import math
import sys

KEYS = [
    "validate_vs_raw", "validate_vs_select1", "validate_p99_vs_raw", "heartbeat_vs_raw",
    "heartbeat_vs_naive", "acquire_vs_raw", "takeover_vs_raw", "release_vs_raw",
    "batch_heartbeat_vs_single", "contention_vs_raw", "scale_p50_1m_vs_1k",
    "core_decisions_per_s", "grant_registry_rss_growth_mib", "telemetry_overhead_validate",
    "notice_to_lost_p50_ms", "notice_to_lost_without_p50_ms", "audit_insert_20m_vs_empty",
    "audit_archive_rows_per_s", "heartbeat_stamp_checks_vs_before",
    "heartbeat_stamp_checks_vs_before_no_flush", "supervisor_threads_10k",
    "supervisor_renewal_round_trips_10k", "supervisor_leases_per_s",
    "supervisor_leases_vs_single", "turn_cpu_10k_vs_1k", "keep_lines",
    "coalesced_validate_8_vs_single",
    "coalesced_validate_32_vs_single", "gateway_requests_vs_plain_app",
    "gateway_effect_requests_vs_plain_app",
]
# Measured only where Redis answers (bench/peers.py): finite when present.
PEERS = ["renewal_vs_redis_extend", "validate_vs_redis_check"]
with open(sys.argv[1], encoding="utf-8") as f:
    figures = json.load(f)
if not isinstance(figures, dict):
    sys.exit(f"bench quick check: expected one JSON object, got {type(figures).__name__}")
problems = [f"missing {key}" for key in KEYS if key not in figures]
problems += [f"{key} = {figures[key]!r} is not a finite number" for key in KEYS + PEERS
             if key in figures and (isinstance(figures[key], bool)
                                    or not isinstance(figures[key], (int, float))
                                    or not math.isfinite(figures[key]))]
if problems:
    sys.exit("bench quick check FAILED: " + "; ".join(problems))
peers = [key for key in PEERS if key in figures]
print(f"bench quick check: all {len(KEYS)} figures present and finite, and {len(peers)} of "
      f"{len(PEERS)} peer ratios (Redis {'measured' if peers else 'absent'})")
PY
