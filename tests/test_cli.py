"""The demo tells the failover story the README promises, through the console script."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from importlib import metadata

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    DenyAllPolicy,
    cli,
    demo,
)


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


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mos-lease {metadata.version('mos-lease')}"
    done = subprocess.run([sys.executable, "-m", "mos_lease.cli", "--version"],
                          capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == f"mos-lease {metadata.version('mos-lease')}"


def test_the_stand_ins_cover_every_postgresql_command() -> None:
    from mos_lease_pg import cli as pg_cli

    assert cli.PG_COMMANDS == pg_cli.COMMANDS
    parser = argparse.ArgumentParser()
    pg_cli.register(parser.add_subparsers())
    registered = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert tuple(registered[0].choices) == pg_cli.COMMANDS


ARGUMENT_SHAPES = [
    (),
    ("--dsn", "x"),
    ("--dsn", "x", "--json"),
    ("--dsn", "x", "--schema", "s", "--behind-pooler", "--print", "extra", "-q"),
    ("--help",),
    ("-h",),
]


@pytest.mark.parametrize("command", cli.PG_COMMANDS)
def test_without_the_pg_extra_every_command_prints_the_install_hint(
        command: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # None in sys.modules makes the import fail as a missing module would.
    monkeypatch.setitem(sys.modules, "mos_lease_pg.cli", None)
    for shape in ARGUMENT_SHAPES:
        assert cli.main([command, *shape]) == 2, shape
        captured = capsys.readouterr()
        assert "pip install 'mos-lease[pg]'" in captured.err, shape
        assert "unrecognized" not in captured.err and captured.out == "", shape


def test_without_the_pg_extra_other_commands_still_check_their_arguments(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "mos_lease_pg.cli", None)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--dsn", "x"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --dsn x" in capsys.readouterr().err


def test_with_the_pg_extra_unknown_arguments_are_still_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["status", "--dsn", "x", "--no-such-flag"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def _policy_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "mos_lease" and r.levelno == logging.WARNING and "policy" in r.message]


def test_a_coordinator_on_the_deny_all_default_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="mos_lease")
    ConnectorLeaseCoordinator()
    AsyncConnectorLeaseCoordinator()
    warned = _policy_warnings(caplog)
    assert len(warned) == 2
    for record in warned:
        assert "DenyAllPolicy" in record.message and "pass policy=" in record.message
    caplog.clear()
    ConnectorLeaseCoordinator(policy=AllowAllPolicy())
    AsyncConnectorLeaseCoordinator(policy=DenyAllPolicy())  # chosen on purpose: no warning
    assert _policy_warnings(caplog) == []
