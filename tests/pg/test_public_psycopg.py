"""The PostgreSQL store uses psycopg's documented API only, and psycopg's own statement
preparation: one mechanism, with the store's promises about it kept.

The source scan fails on any reach into psycopg's internals (private modules, the
generators and ``Transformer`` layer, ``error_from_result``, the connection's ``pgconn``,
``wait`` and ``lock``), which psycopg reworks between minor releases. The database tests
check what preparation promises: prepared once per connection, nothing prepared when told
so, kept across pool checkouts, and recovered (a write applied exactly once) when the
server forgets a statement behind psycopg's back, as a proxy's reset does.
"""

from __future__ import annotations

import ast
import asyncio
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseHandle, LeaseIdentity
from mos_lease.ids import uuid7
from mos_lease.machine import Renew
from mos_lease.records import AuditEntry
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg import (
    AsyncPostgresLeaseStore,
    ConnectionSettings,
    PostgresLeaseStore,
    make_pool,
)
from mos_lease_pg import wire as wire_module
from tests.pg_fixtures import StoreFactory

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mos_lease", "mos_lease_pg", "mos_lease_memory", "mos_lease_tmux")

# psycopg modules whose use means driving its internals.
_INTERNAL_MODULES = frozenset({"generators", "waiting"})
# Names that belong to psycopg's internals wherever they are looked up. (Its internal
# modules count only where they come from psycopg: a function of our own may be "waiting".)
_INTERNAL_NAMES = frozenset({"Transformer", "error_from_result", "pgconn", "PrepareManager"})
# Connection methods that are not part of its documented API: only flagged on a receiver
# whose name says it is a connection (``threading.Event.wait`` is fine).
_CONNECTION_INTERNALS = frozenset({"wait", "lock"})


def _receiver(node: ast.expr) -> str:
    """The last name of an attribute's receiver: ``conn`` for ``self.conn.wait``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _internal_attribute(owner: str, attr: str) -> bool:
    """Whether ``owner.attr`` is a private part of psycopg, a connection or a cursor."""
    if owner in ("psycopg", "psycopg_pool"):
        return attr.startswith("_") or attr in _INTERNAL_MODULES
    if attr in _CONNECTION_INTERNALS:
        return "conn" in owner.lower()
    return attr.startswith("_") and owner in ("conn", "connection", "cursor", "_cursor", "cur")


def internal_uses(source: str) -> list[str]:
    """Every reach into psycopg's internals in ``source``, as ``line: what``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""])
            names = [] if isinstance(node, ast.Import) else [a.name for a in node.names]
            for module in modules:
                parts = module.split(".")
                if parts[0] not in ("psycopg", "psycopg_pool"):
                    continue
                if any(p.startswith("_") or p in _INTERNAL_MODULES for p in parts[1:]):
                    found.append(f"{line}: import of {module}")
                for name in names:
                    if name.startswith("_") or name in _INTERNAL_NAMES | _INTERNAL_MODULES:
                        found.append(f"{line}: {name} from {module}")
        elif isinstance(node, ast.Attribute):
            owner = _receiver(node.value)
            if node.attr in _INTERNAL_NAMES:
                found.append(f"{line}: .{node.attr}")
            elif _internal_attribute(owner, node.attr):
                found.append(f"{line}: {owner}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in _INTERNAL_NAMES:
            found.append(f"{line}: {node.id}")
    return found


def _package_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_the_packages_use_only_psycopgs_public_api() -> None:
    files = _package_files()
    assert any(p.name == "store.py" for p in files)  # the scan looks where the code is
    bad = {str(p.relative_to(ROOT)): uses for p in files
           if (uses := internal_uses(p.read_text("utf-8")))}
    assert bad == {}


@pytest.mark.parametrize("snippet", [
    "from psycopg.generators import execute",
    "import psycopg.generators",
    "from psycopg import generators",
    "from psycopg.adapt import Transformer",
    "from psycopg._preparing import Prepare",
    "import psycopg._cursor_base",
    "from psycopg.errors import error_from_result",
    "e = psycopg.errors.error_from_result(r)",
    "x = psycopg._encodings",
    "conn.wait(gen)",
    "self.conn.wait(gen)",
    "with conn.lock: pass",
    "conn.pgconn.send_query(b'')",
    "n = conn._prepared",
    "cursor._tx.load_rows(0, 1, tuple)",
    "tx = Transformer(conn)",
], ids=repr)
def test_the_scan_catches_each_kind_of_internal_use(snippet: str) -> None:
    assert internal_uses(snippet)


@pytest.mark.parametrize("snippet", [
    "import psycopg", "from psycopg import errors", "from psycopg.rows import tuple_row",
    "from psycopg.conninfo import conninfo_to_dict", "from psycopg.pq import TransactionStatus",
    "self._work.wait()", "event.wait(1)", "cur = conn.cursor(binary=True)",
    "cur.execute(b'SELECT 1', prepare=True)", "with self._lock: pass",
], ids=repr)
def test_the_scan_accepts_the_public_api(snippet: str) -> None:
    assert internal_uses(snippet) == []


# --- psycopg's preparation, as the store uses it ------------------------------------------

_PREPARED = b"SELECT name FROM pg_prepared_statements ORDER BY name"


def _prepared(conn: psycopg.Connection[Any]) -> list[str]:
    """The statements prepared in ``conn``'s session (no other session can see them)."""
    return [row[0] for row in conn.execute(_PREPARED, prepare=False).fetchall()]


def _conn(store: PostgresLeaseStore) -> psycopg.Connection[Any]:
    with store._source.checkout() as wire:
        return wire.conn


def _identity(tenant: str, binding: str = "binding") -> LeaseIdentity:
    return LeaseIdentity(tenant, "agent", binding)


@pytest.mark.pg
def test_a_statement_is_prepared_once_per_connection(pg_stores: StoreFactory,
                                                      pg_tenant: str) -> None:
    store = pg_stores()
    assert store.load(_identity(pg_tenant)).row is None
    conn = _conn(store)
    first = _prepared(conn)  # the load, and the first use's schema check
    for _ in range(4):
        assert store.load(_identity(pg_tenant)).row is None
    assert _prepared(conn) == first
    store.now()
    assert len(_prepared(conn)) == len(first) + 1


@pytest.mark.pg
def test_prepare_off_prepares_nothing(pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores(settings=ConnectionSettings(prepare=False))
    for _ in range(3):
        assert store.load(_identity(pg_tenant)).row is None
    store.now()
    assert _prepared(_conn(store)) == []


@pytest.mark.pg
def test_a_pooled_connection_keeps_its_prepared_statements(pg_dsn: str,
                                                           pg_tenant: str) -> None:
    with make_pool(pg_dsn, min_size=1, max_size=1) as pool:
        store = PostgresLeaseStore(pool=pool)
        store.load(_identity(pg_tenant))
        with pool.connection() as conn:
            first = _prepared(conn)
        for _ in range(3):  # a checkout each, on the pool's one connection
            store.load(_identity(pg_tenant))
        store.now()
        with pool.connection() as conn:
            assert len(_prepared(conn)) == len(first) + 1


def _forget(conn: psycopg.Connection[Any]) -> list[str]:
    """Deallocate every prepared statement of ``conn``'s session one by one, as a proxy's
    reset would: psycopg does not see it (only ``DEALLOCATE ALL`` sent through it clears
    its cache), so it still believes them prepared."""
    names = _prepared(conn)
    assert names
    for name in names:
        conn.execute(f'DEALLOCATE "{name}"'.encode(), prepare=False)
    assert _prepared(conn) == []
    return names


@pytest.mark.pg
def test_a_read_survives_the_server_forgetting_its_statement(pg_stores: StoreFactory,
                                                             pg_tenant: str) -> None:
    store = pg_stores()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    assert coordinator.acquire(_identity(pg_tenant), "conn-a", scopes=("tool:run",),
                               ttl=60).ok
    store.load(_identity(pg_tenant))
    _forget(_conn(store))
    snapshot = store.load(_identity(pg_tenant))
    assert snapshot.row is not None and snapshot.row.connector_id == "conn-a"
    # Served prepared again from then on, on the connection it now uses.
    conn = _conn(store)
    prepared = _prepared(conn)
    store.load(_identity(pg_tenant))
    assert len(prepared) == 1 and _prepared(conn) == prepared


@pytest.mark.pg
def test_a_write_survives_the_server_forgetting_its_statement_and_applies_once(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    lease = coordinator.acquire(_identity(pg_tenant), "conn-a", scopes=("tool:run",),
                                ttl=60).lease
    assert lease is not None
    assert coordinator.heartbeat(lease, ttl=60).ok  # the renew statement is now prepared
    _forget(_conn(store))
    renewed = coordinator.heartbeat(lease, ttl=60)
    assert renewed.ok
    records = store.audit(_identity(pg_tenant))
    # Acquire and two heartbeats: the one sent again is recorded once.
    assert [r.entry.event for r in records] == [LifecycleEvent.ACQUIRE,
                                                LifecycleEvent.HEARTBEAT,
                                                LifecycleEvent.HEARTBEAT]
    assert len({r.entry.event_id for r in records}) == 3


def _renewals(*leases: LeaseHandle) -> list[tuple[Renew, AuditEntry]]:
    return [(Renew(lease.identity, lease.connector_id, lease.lease_id, lease.epoch,
                   timedelta(seconds=60)),
             AuditEntry(uuid7(), LifecycleEvent.HEARTBEAT, Outcome.RENEWED, None,
                        lease.identity, lease.connector_id, lease.epoch, "batch"))
            for lease in leases]


@pytest.mark.pg
def test_a_batch_of_heartbeats_survives_the_server_forgetting_its_statement(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    leases = []
    for name in ("one", "two"):
        lease = coordinator.acquire(_identity(pg_tenant, name), "conn-a",
                                    scopes=("tool:run",), ttl=60).lease
        assert lease is not None
        leases.append(lease)
    assert all(o.row is not None for o in store.renew_many(_renewals(*leases)))
    _forget(_conn(store))
    outcomes = store.renew_many(_renewals(*leases))
    assert all(o.row is not None for o in outcomes)
    # The batch sent again is recorded once.
    for name in ("one", "two"):
        assert [r.entry.event for r in store.audit(_identity(pg_tenant, name))] == [
            LifecycleEvent.ACQUIRE, LifecycleEvent.HEARTBEAT, LifecycleEvent.HEARTBEAT]


@pytest.mark.pg
def test_the_async_store_survives_the_server_forgetting_its_statement(
        pg_dsn: str, pg_tenant: str) -> None:
    async def scenario() -> tuple[bool, int]:
        async with AsyncPostgresLeaseStore(pg_dsn) as store:
            await store.load(_identity(pg_tenant))
            async with store._source.checkout() as wire:
                cur = await wire.conn.execute(_PREPARED, prepare=False)
                for (name,) in await cur.fetchall():
                    await wire.conn.execute(f'DEALLOCATE "{name}"'.encode(), prepare=False)
            missing = (await store.load(_identity(pg_tenant))).row is None
            async with store._source.checkout() as wire:
                cur = await wire.conn.execute(_PREPARED, prepare=False)
                return missing, len(await cur.fetchall())

    assert asyncio.run(scenario()) == (True, 1)  # the load, prepared on a fresh connection


@pytest.mark.pg
def test_a_statement_error_leaves_the_shared_cursor_usable(pg_stores: StoreFactory,
                                                          pg_tenant: str) -> None:
    store = pg_stores()
    with store._source.checkout() as wire, pytest.raises(psycopg.errors.DivisionByZero):
        wire.execute(b"SELECT 1 / %(zero)s::int", {"zero": 0})
    assert store.load(_identity(pg_tenant)).row is None


@pytest.mark.pg
def test_a_long_reply_is_not_kept_after_the_call(pg_stores: StoreFactory, pg_tenant: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared cursor would hold a long reply's memory until the next statement."""
    monkeypatch.setattr(wire_module, "KEEP_RESULT_ROWS", 2)
    store = pg_stores()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    lease = coordinator.acquire(_identity(pg_tenant), "conn-a", scopes=("tool:run",),
                                ttl=60).lease
    assert lease is not None
    assert coordinator.heartbeat(lease, ttl=60).ok
    with store._source.checkout() as wire:
        before = wire._cursor
    assert len(store.audit(_identity(pg_tenant))) == 2  # not longer than kept
    with store._source.checkout() as wire:
        assert wire._cursor is before and before.pgresult is not None
    assert coordinator.heartbeat(lease, ttl=60).ok
    assert len(store.audit(_identity(pg_tenant))) == 3  # longer: let go
    with store._source.checkout() as wire:
        assert before.closed and before.pgresult is None
        assert wire._cursor is not before and wire._cursor.pgresult is None
    assert store.load(_identity(pg_tenant)).row is not None  # and the new cursor works


@pytest.mark.pg
def test_threads_sharing_one_store_never_mix_their_replies(pg_stores: StoreFactory,
                                                           pg_tenant: str) -> None:
    """Singles and pipelined batches from several threads on one dedicated connection and
    its one cursor: every reply belongs to the call that asked."""
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: between any two steps
    store = pg_stores()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    leases: dict[int, LeaseHandle] = {}
    for i in range(_THREADS):
        lease = coordinator.acquire(_identity(pg_tenant, f"b{i}"), f"conn-{i}",
                                    scopes=("tool:run",), ttl=60).lease
        assert lease is not None
        leases[i] = lease
    errors: list[str] = []

    def work(i: int) -> None:
        try:
            for k in range(120):
                row = store.load(_identity(pg_tenant, f"b{i}")).row
                if row is None or row.connector_id != f"conn-{i}":
                    errors.append(f"thread {i} read {row}")
                if k % 10 == 0:
                    pair = [leases[i], leases[(i + 1) % _THREADS]]
                    results = coordinator.heartbeat_many(pair, ttl=60)
                    if len(results) != 2 or not all(r.ok for r in results):
                        errors.append(f"thread {i} batch {results}")
        except Exception as exc:
            errors.append(f"thread {i}: {exc!r}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(_THREADS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(_SWITCH)
    assert errors == []


_THREADS = 6
_SWITCH = sys.getswitchinterval()
