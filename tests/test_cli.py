"""The demo tells the failover story the README promises, through the console script."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mos_lease import cli, demo


def test_demo_narrates_failover_and_refusals() -> None:
    lines: list[str] = []
    assert demo.run(lines.append) == 0
    text = "\n".join(lines)
    assert "claude-a acquires the lease" in text and "acquired at epoch 1" in text
    assert "REFUSED: takeover_required" in text
    assert "taken_over at epoch 2" in text
    refusals = [line for line in lines if line.startswith("t+") and "claude-a" in line
                and "REFUSED" in line]
    assert [line.rsplit("REFUSED: ", 1)[1] for line in refusals] == [
        "stale_epoch", "stale_epoch", "grant_expired", "stale_epoch"]
    trail = lines[lines.index(next(x for x in lines if x.startswith("seq"))) + 1:]
    assert len(trail) == 8
    assert "tool:shell" not in "\n".join(trail)


def test_console_script_runs_the_demo() -> None:
    done = subprocess.run([sys.executable, "-m", "mos_lease.cli", "demo"], capture_output=True,
                          text=True, check=True, timeout=60)
    assert "taken_over at epoch 2" in done.stdout


def test_cli_requires_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "demo" in capsys.readouterr().err
