"""The test-server discovery itself: explicit DSN first, Docker only when an engine answers,
a throwaway initdb cluster as the fallback, and a clear message when nothing is there."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import psycopg
import pytest

from tests import pg_support
from tests.pg_support import PgServer

pytestmark = pytest.mark.pg

NOWHERE = "host=127.0.0.1 port=1 user=postgres dbname=postgres"


def test_an_explicit_dsn_wins_and_is_never_second_guessed(pg_server: PgServer,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
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
    assert pg_support._from_testcontainers() is None
    fake = os.path.join(tmp_path, "docker.sock")
    open(fake, "w").close()  # a socket file with no engine behind it
    monkeypatch.setenv("DOCKER_HOST", f"unix://{fake}")
    assert pg_support._docker_socket() == fake
    assert pg_support._docker_answers(fake) is False
    assert pg_support._from_testcontainers() is None


def test_throwaway_cluster_from_initdb() -> None:
    server = pg_support._from_initdb()
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        assert server is None
        return
    assert server is not None and server.how == "initdb"
    try:
        assert pg_support.answers(server.dsn) is None
        with psycopg.connect(server.dsn) as conn:
            row = conn.execute("SHOW fsync").fetchone()
        assert row == ("off",)
    finally:
        server.stop()
    assert pg_support.answers(server.dsn) is not None


def test_the_message_says_what_to_install_or_set() -> None:
    for hint in ("MOS_LEASE_TEST_DSN", "127.0.0.1:5432", "testcontainers", "initdb",
                 "apt-get install postgresql"):
        assert hint in pg_support.HOW_TO_GET_ONE


@pytest.mark.parametrize(("require", "outcome"), [("0", "1 skipped"), ("1", "1 error")])
def test_no_server_skips_or_fails_when_required(require: str, outcome: str,
                                                tmp_path: os.PathLike[str]) -> None:
    test_file = os.path.join(tmp_path, "test_needs_pg.py")
    with open(test_file, "w") as handle:
        handle.write("def test_needs_pg(pg_dsn):\n    assert pg_dsn\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, pg_support.ENV_DSN: NOWHERE, pg_support.ENV_REQUIRE: require,
           "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "tests.pg_fixtures", "-p",
         "no:cacheprovider", "--rootdir", str(tmp_path), test_file],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert outcome in done.stdout, done.stdout + done.stderr
    assert "MOS_LEASE_TEST_DSN is set but the server does not answer" in done.stdout
