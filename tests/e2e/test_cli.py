"""The ``mos-lease`` command: the demo tells the failover story the README promises, the
PostgreSQL commands answer with an install hint when the pg extra is missing (and only
then), and a coordinator on the deny-all default says so."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import types
from collections.abc import Callable, Sequence
from importlib import metadata

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    DenyAllPolicy,
    cli,
)
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore, demo


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


# The PostgreSQL commands, as the pg adapter names them (mos_lease_pg.admin.cli.COMMANDS);
# read from the package here only where psycopg is installed.
PG_COMMANDS = ("setup", "roles", "migrate", "check", "status", "audit")
PG_EXTRA_MODULES = ("psycopg", "psycopg_pool")


def _registered(add: Callable[[cli.Commands], object]) -> list[str]:
    parser = argparse.ArgumentParser()
    add(parser.add_subparsers())
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(commands.choices)


def test_each_entry_point_adds_the_command_it_is_named_for() -> None:
    """The adapters register every command, each under its own name, and the core names
    none of them: the entry points are the whole list."""
    from mos_lease_pg.admin import cli as pg_cli

    points = {point.name: point for point in metadata.entry_points(group=cli.GROUP)}
    assert sorted(points) == sorted(("demo", *PG_COMMANDS))
    assert tuple(pg_cli.COMMANDS) == PG_COMMANDS
    for name, point in points.items():
        assert _registered(point.load()) == [name]
    assert _registered(pg_cli.register) == list(PG_COMMANDS)


ARGUMENT_SHAPES = [
    (),
    ("--dsn", "x"),
    ("--dsn", "x", "--json"),
    ("--dsn", "x", "--schema", "s", "--behind-pooler", "--print", "extra", "-q"),
    ("--help",),
    ("-h",),
]


# Run in a fresh interpreter: there the pg extra's modules can be made missing (None in
# sys.modules fails their import as an absent module would) before anything loads them.
_CLI_WITHOUT = """
import contextlib, io, json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None
from mos_lease import cli
results = []
for argv in json.loads(sys.argv[2]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def _run_without(missing: Sequence[str], *argvs: Sequence[str]
                 ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CLI_WITHOUT, json.dumps(list(missing)),
                           json.dumps([list(argv) for argv in argvs])],
                          capture_output=True, text=True, timeout=60, check=False)


def _cli_without(missing: Sequence[str], *argvs: Sequence[str]) -> list[tuple[int, str, str]]:
    """``cli.main(argv)`` for each argv, where the modules ``missing`` cannot be imported:
    (exit code, stdout, stderr) of each."""
    done = _run_without(missing, *argvs)
    assert done.returncode == 0, done.stderr
    return [(code, out, err) for code, out, err in json.loads(done.stdout)]


@pytest.mark.parametrize("command", PG_COMMANDS)
def test_without_the_pg_extra_every_command_prints_the_install_hint(command: str) -> None:
    results = _cli_without(["psycopg"], *[(command, *shape) for shape in ARGUMENT_SHAPES])
    for shape, (code, out, err) in zip(ARGUMENT_SHAPES, results, strict=True):
        assert code == 2, shape
        assert "pip install 'mos-lease[pg]'" in err, shape
        assert "unrecognized" not in err and out == "", shape


@pytest.mark.parametrize("missing", PG_EXTRA_MODULES)
def test_each_module_of_the_pg_extra_missing_gives_the_install_hint(missing: str) -> None:
    ((code, out, err),) = _cli_without([missing], ("status", "--dsn", "x"))
    assert code == 2 and out == ""
    assert "PostgreSQL support is not installed" in err and missing in err


def test_psycopg_without_a_libpq_gives_the_libpq_hint_and_the_rest_still_works() -> None:
    # The pg extra brings psycopg without a libpq of its own; asking psycopg for an
    # implementation that is not installed fails its import as a missing libpq does.
    impl = next((name for name in ("c", "binary")
                 if importlib.util.find_spec(f"psycopg_{name}") is None), None)
    assert impl is not None, "psycopg's c and binary builds are both installed here"
    env = {**os.environ, "PSYCOPG_IMPL": impl}

    def command(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mos_lease.cli", *argv], env=env,
                              capture_output=True, text=True, timeout=60, check=False)

    listed = command("--help")
    assert listed.returncode == 0, listed.stderr
    assert "demo" in listed.stdout and "status" in listed.stdout
    refused = command("status", "--dsn", "x")
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert "psycopg cannot load libpq" in refused.stderr, refused.stderr
    assert "pip install 'mos-lease[binary]'" in refused.stderr, refused.stderr


def test_without_the_pg_extra_other_commands_still_check_their_arguments() -> None:
    ((code, _, err),) = _cli_without(["psycopg"], ("demo", "--dsn", "x"))
    assert code == 2
    assert "unrecognized arguments: --dsn x" in err


def test_a_fault_inside_mos_lease_pg_is_not_reported_as_a_missing_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With psycopg installed, a failure to load mos_lease_pg itself is a bug there and
    propagates: a missing module of the package, a name it no longer defines, or a module
    deep inside it that fails to load."""
    monkeypatch.setitem(sys.modules, "mos_lease_pg.admin.cli", None)
    with pytest.raises(ModuleNotFoundError) as missing_module:
        cli.main(["status", "--dsn", "x"])
    assert missing_module.value.name == "mos_lease_pg.admin.cli"
    monkeypatch.setitem(sys.modules, "mos_lease_pg.admin.cli",
                        types.ModuleType("mos_lease_pg.admin.cli"))
    with pytest.raises(AttributeError, match="add_audit"):
        cli.main(["demo"])
    done = _run_without(["mos_lease_pg.statements"], ("status", "--dsn", "x"))
    assert done.returncode == 1
    assert "ModuleNotFoundError" in done.stderr and "mos_lease_pg.statements" in done.stderr
    assert "pip install" not in done.stdout + done.stderr


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
    ConnectorLeaseCoordinator(InMemoryLeaseStore())
    AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore())
    warned = _policy_warnings(caplog)
    assert len(warned) == 2
    for record in warned:
        assert "DenyAllPolicy" in record.message and "pass policy=" in record.message
    caplog.clear()
    ConnectorLeaseCoordinator(InMemoryLeaseStore(), policy=AllowAllPolicy())
    # Deny-all chosen on purpose: no warning.
    AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), policy=DenyAllPolicy())
    assert _policy_warnings(caplog) == []
