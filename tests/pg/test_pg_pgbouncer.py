"""The store through a real PgBouncer in transaction mode, two server sessions shared by every
client (``tests/pgbouncer.py``).

With ``POOLER_SETTINGS`` the store meets the contract and a takeover race has one winner per
epoch. With anything else it is refused at first use with a ``ConfigurationError`` naming
those settings, never a ``StoreUnavailable`` per call: PgBouncer refuses the startup options
the default settings send, and prepared statements collide in shared server sessions (both
reproduced here on the pooler itself, below the store).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
)
from mos_lease.testing import run_store_contract
from mos_lease.vocabulary import Outcome
from mos_lease_pg import (
    AsyncPostgresLeaseStore,
    ConnectionSettings,
    PostgresLeaseStore,
    make_pool,
)
from mos_lease_pg.translate import POOLER_SETTINGS, statement_failure
from tests import tools
from tests.helpers import claim
from tests.pg_fixtures import PgSchema, PostgresHarness, StoreFactory
from tests.pg_support import PgServer
from tests.pgbouncer import POOL_SIZE, PgBouncer

pytestmark = pytest.mark.pg

POOLED = ConnectionSettings(session_options=False, prepare=False)
CLIENTS = 6
SCOPES = ["tool:run"]
T = TypeVar("T")


def in_threads(count: int, work: Callable[[int, threading.Barrier], T]) -> list[T]:
    """Run ``work(n, barrier)`` in ``count`` threads at once; their results (or raise the
    first error)."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            results[n] = work(n, barrier)
        except BaseException as exc:  # the test asserts on it
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]
    return results


def test_six_clients_share_two_server_sessions(pgbouncer: PgBouncer, pg_dsn: str) -> None:
    # The fixture is what it claims: a transaction pooler whose clients hold no server
    # session between transactions, and whose startup answer is its own.
    def backend(_n: int, barrier: threading.Barrier) -> tuple[int, int]:
        with psycopg.connect(pgbouncer.dsn(pg_dsn), autocommit=True) as conn:
            barrier.wait(timeout=30)
            row = conn.execute("SELECT pg_backend_pid()", prepare=False).fetchone()
            assert row is not None
            return conn.info.backend_pid, row[0]

    seen = in_threads(CLIENTS, backend)
    answered = {pid for _, pid in seen}
    assert 1 <= len(answered) <= POOL_SIZE
    assert not answered & {announced for announced, _ in seen}
    with psycopg.connect(pg_dsn, autocommit=True) as direct:
        row = direct.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None and row[0] == direct.info.backend_pid


def test_the_store_contract_through_pgbouncer(pgbouncer: PgBouncer, pg_stores: StoreFactory,
                                              pg_migrated_schema_dsn: PgSchema) -> None:
    schema = pg_migrated_schema_dsn
    settings = schema.settings(session_options=False, prepare=False)
    store = pg_stores(pgbouncer.dsn(schema.dsn), settings=settings)
    others = [pg_stores(pgbouncer.dsn(schema.dsn), settings=settings) for _ in range(3)]
    with busy(others):  # other clients take turns on the two server sessions meanwhile
        run_store_contract(lambda: PostgresHarness(store), steps=300)
        # They did: one client's successive transactions ran in different server sessions.
        with psycopg.connect(pgbouncer.dsn(schema.dsn), autocommit=True) as probe:
            answered = {probe.execute("SELECT pg_backend_pid()", prepare=False).fetchone()
                        for _ in range(100)}
        assert len(answered) == POOL_SIZE, answered


@contextmanager
def busy(stores: Sequence[PostgresLeaseStore]) -> Iterator[None]:
    """Keep ``stores`` reading in threads of their own for the duration of the block."""
    stop = threading.Event()
    calls = Counter[int]()

    def read(n: int) -> None:
        while not stop.is_set():
            stores[n].now()
            calls[n] += 1

    threads = [threading.Thread(target=read, args=(n,), daemon=True) for n in range(len(stores))]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert all(calls[n] > 0 for n in range(len(stores))), calls


def test_a_takeover_race_through_pgbouncer_has_one_winner_per_epoch(
        pgbouncer: PgBouncer, pg_dsn: str, pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "raced")
    rounds = 30

    def racer(n: int, barrier: threading.Barrier) -> list[int]:
        won: list[int] = []
        with PostgresLeaseStore(pgbouncer.dsn(pg_dsn), settings=POOLED) as store:
            gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
            for _ in range(rounds):
                barrier.wait(timeout=60)
                result = claim(gateway, identity, f"c{n}", store.load(identity).row,
                               scopes=SCOPES, ttl=120)
                if result.lease is not None:
                    won.append(result.lease.epoch)
        return won

    wins = Counter(epoch for won in in_threads(CLIENTS, racer) for epoch in won)
    assert wins and max(wins.values()) == 1, f"two winners for one epoch: {wins}"
    with PostgresLeaseStore(pg_dsn) as store:
        taken = [r.entry.epoch for r in store.audit(identity, limit=10_000)
                 if r.entry.outcome in (Outcome.ACQUIRED, Outcome.TAKEN_OVER)]
        row = store.load(identity).row
    assert taken == list(range(1, len(taken) + 1)), taken
    assert set(taken) == set(wins)
    assert row is not None and row.epoch == len(taken)
    # Every round had a winner, and every round's losers raced (more attempts than wins).
    assert rounds <= len(taken) < rounds * CLIENTS


def test_with_the_pooler_settings_every_store_works(pgbouncer: PgBouncer, pg_dsn: str,
                                                    pg_tenant: str) -> None:
    def lifecycle(n: int, barrier: threading.Barrier) -> bool:
        with PostgresLeaseStore(pgbouncer.dsn(pg_dsn), settings=POOLED) as store:
            gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
            identity = LeaseIdentity(pg_tenant, "agent", f"b{n}")
            barrier.wait(timeout=30)
            lease = gateway.acquire(identity, "c1", scopes=SCOPES, ttl=30).lease
            assert lease is not None
            grant = gateway.issue_grant(lease, scopes=SCOPES, ttl=5).grant
            assert grant is not None
            return gateway.validate(grant, identity=identity, scopes=SCOPES).ok

    assert in_threads(CLIENTS, lifecycle) == [True] * CLIENTS


def _refused(error: ConfigurationError, sign: str) -> None:
    assert POOLER_SETTINGS in str(error)
    assert sign in str(error), str(error)


def test_default_settings_are_refused_at_first_use(pgbouncer: PgBouncer, pg_dsn: str,
                                                   pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    with PostgresLeaseStore(pgbouncer.dsn(pg_dsn)) as store:
        # PgBouncer refuses the startup options that carry the timeouts; every call says so.
        for _ in range(2):
            with pytest.raises(ConfigurationError) as refused:
                store.load(identity)
            _refused(refused.value, "unsupported startup parameter: options")

    async def scenario() -> None:
        async with AsyncPostgresLeaseStore(pgbouncer.dsn(pg_dsn)) as store:
            with pytest.raises(ConfigurationError) as refused:
                await store.load(identity)
            _refused(refused.value, "unsupported startup parameter: options")

    asyncio.run(scenario())


def test_a_pooler_that_drops_the_startup_options_is_refused_too(pg_server: PgServer,
                                                                pg_dsn: str,
                                                                pg_tenant: str) -> None:
    # Told to ignore them, PgBouncer admits the connection and silently drops the timeouts
    # the options carry: the store must not run on, believing its statements bounded.
    tools.need(tools.PGBOUNCER)
    lenient = PgBouncer(pg_server.dsn, ignore_startup_parameters="options")
    try:
        with PostgresLeaseStore(lenient.dsn(pg_dsn),
                                settings=ConnectionSettings(prepare=False)) as store:
            with pytest.raises(ConfigurationError) as refused:
                store.load(LeaseIdentity(pg_tenant, "agent", "b1"))
            _refused(refused.value, "but backend")
    finally:
        lenient.stop()


def test_prepared_statements_collide_in_shared_server_sessions(pgbouncer: PgBouncer,
                                                               pg_dsn: str) -> None:
    # The pooler itself, below the store: psycopg names prepared statements per connection
    # (as the store's prepare=True does), so the next client to prepare one in a server
    # session an earlier client used is refused.
    failed: list[psycopg.Error | None] = []
    for _ in range(CLIENTS):
        with psycopg.connect(pgbouncer.dsn(pg_dsn), autocommit=True,
                             prepare_threshold=0) as conn:
            try:
                conn.execute("SELECT %s::int", [1])
                failed.append(None)
            except psycopg.Error as exc:
                failed.append(exc)
    assert failed[0] is None  # the first one prepared it
    states = [error.sqlstate for error in failed if error is not None]
    assert "42P05" in states and set(states) <= {"42P05", "26000"}, states
    # Where the first-use check could not see the pooler, "already exists" still names
    # the fix: psycopg never prepares a name twice on one server session of its own.
    for found in failed:
        if found is not None and found.sqlstate == "42P05":
            error = statement_failure(found, what="load", write_event=None).error
            assert isinstance(error, ConfigurationError)
            _refused(error, "already exists")


def test_prepared_statements_behind_pgbouncer_are_refused_at_first_use(
        pgbouncer: PgBouncer, pg_dsn: str, pg_tenant: str) -> None:
    settings = ConnectionSettings(session_options=False)  # prepare=True
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    stores = [PostgresLeaseStore(pgbouncer.dsn(pg_dsn), settings=settings)
              for _ in range(CLIENTS)]
    try:
        for store in stores:
            for _ in range(2):
                with pytest.raises(ConfigurationError) as refused:
                    store.load(identity)
                _refused(refused.value, "but backend")
    finally:
        for store in stores:
            store.close()
    with make_pool(pgbouncer.dsn(pg_dsn), settings, max_size=2) as pool, \
            PostgresLeaseStore(pool=pool, settings=settings) as pooled:
        with pytest.raises(ConfigurationError) as refused:
            pooled.load(identity)
        _refused(refused.value, "but backend")

    async def scenario() -> None:
        async with AsyncPostgresLeaseStore(pgbouncer.dsn(pg_dsn), settings=settings) as store:
            with pytest.raises(ConfigurationError) as refused:
                await store.load(identity)
            _refused(refused.value, "but backend")

    asyncio.run(scenario())


@pytest.mark.parametrize("require", [False, True])
def test_without_pgbouncer_it_skips_naming_the_package_or_fails_when_required(
        require: bool) -> None:
    output = tools.run_without_tools(
        "tests/pg/test_pg_pgbouncer.py::test_six_clients_share_two_server_sessions",
        require=require)
    assert "pgbouncer not installed (Debian: apt-get install pgbouncer)" in output, output
    if require:
        # The fixture fails, so the test errors at setup.
        assert "1 error" in output and "MOS_LEASE_REQUIRE_TOOLS is set" in output, output
    else:
        assert "1 skipped" in output and "failed" not in output, output
