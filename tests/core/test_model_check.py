"""The Promela model of the fencing protocol verifies, and fails when the protocol is broken.

``specs/model/check.sh`` model-checks ``specs/model/lease.pml`` with spin: an exhaustive
safety search of two gateways and two connectors over a bounded database clock. The correct
model must come out with ``errors: 0`` and every ``REACH`` path explored; each deliberately
broken variant must produce a counterexample, which proves the assertions can fail.

It needs spin and a C compiler (Debian packages ``spin`` and ``gcc``): without them these
tests skip, naming the packages, and with ``MOS_LEASE_REQUIRE_TOOLS=1`` (CI) they fail instead,
so a CI image without them cannot pass silently (see ``tests/tools.py``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests import tools

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "specs" / "model" / "check.sh"
# The correct model takes ~10-20 s on two cores, a broken one a few seconds; this only
# stops a wedged run.
TIMEOUT_S = 600
# Variables check.sh reads; a developer's own settings must not change what is tested.
CHECK_ENV = ("BUG", "SPIN_DEFINES", "PAN_CFLAGS", "PAN_MEMLIM_MB")

EXIT_VERIFIED = 0
EXIT_VIOLATION = 1


def run_check(bug: str | None) -> subprocess.CompletedProcess[str]:
    tools.need(tools.SPIN, tools.c_compiler())
    env = {name: value for name, value in os.environ.items() if name not in CHECK_ENV}
    if bug is not None:
        env["BUG"] = bug
    return subprocess.run(
        ["bash", str(CHECK)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        check=False,
    )


def failed_assertion(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("spin: text of failed assertion:"):
            return line
    return ""


def test_correct_model_verifies_exhaustively() -> None:
    result = run_check(None)
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_VERIFIED, output
    assert "errors: 0" in output, output
    assert "all 10 REACH paths explored" in output, output
    assert "check.sh: OK: exhaustive search, errors: 0" in output, output


@pytest.mark.parametrize(
    ("bug", "assertion"),
    [
        # BUG=1 is BUG_CACHED_VALIDATE: the monitor sees a grant accepted for a lease that is
        # no longer the current active one.
        ("1", "accepted"),
        # The takeover CAS without the epoch compare: the audit row's epoch is wrong.
        ("no_epoch_cas", "ep+1"),
        # A lost reply retried blindly: the gateway denies a write that committed.
        ("blind_retry", "ev_committed"),
        # No refusal at the maximum epoch: the epoch wraps and goes backwards.
        ("epoch_wrap", "hi_epoch"),
        # The clock read before the row lock (guarded_write.sql's old order): a heartbeat
        # that waited for the lock renews a lease another gateway had already seen expire
        # (A5). The correct model, run above, reads the clock after the lock and passes.
        ("clock_before_lock", "exp_seen"),
    ],
)
def test_broken_variant_yields_a_counterexample(bug: str, assertion: str) -> None:
    result = run_check(bug)
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_VIOLATION, output
    assert "assertion violated" in output, output
    assert assertion in failed_assertion(output), output
    assert "trail ends after" in output, output


@pytest.mark.parametrize("require", [False, True])
def test_without_spin_it_skips_naming_packages_or_fails_when_required(require: bool) -> None:
    output = tools.run_without_tools(
        "tests/core/test_model_check.py::test_correct_model_verifies_exhaustively", require=require)
    assert "spin, gcc not installed (Debian: apt-get install spin gcc)" in output, output
    if require:
        assert "1 failed" in output and "MOS_LEASE_REQUIRE_TOOLS is set" in output, output
    else:
        assert "1 skipped" in output and "failed" not in output, output
