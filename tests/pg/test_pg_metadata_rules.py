"""Holder metadata the library would refuse, in rows written around it with SQL as the
gateway role: a schema at version 9 accepts them; migration 0010 upgrades the populated
schema in place, keeping every row, and from then on the database refuses new ones for every
role; the library withholds the planted ones on every read (``current_holder()``, a refused
acquire's holder, ``mos-lease status``) and every lease operation on those rows still works.
The database's rule (``mos_lease_metadata_problem``) gives the verdicts of
``mos_lease.metadata.check_metadata``."""

from __future__ import annotations

import json
import logging
import unicodedata
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import errors, sql

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, InvalidInput, LeaseIdentity
from mos_lease.metadata import check_metadata
from mos_lease.records import LeaseHandle
from mos_lease.vocabulary import LeaseState
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from mos_lease_pg.admin import migrate
from mos_lease_pg.admin import migrations as migrations_module
from mos_lease_pg.admin.check import ClockReading, Facts, Status, evaluate, run_check
from tests.pg.test_pg_roles import Layout
from tests.pg.test_pg_roles import _apply as apply_roles_file
from tests.pg_fixtures import run_cli as run
from tests.pg_support import unique_name, with_params

pytestmark = pytest.mark.pg

LEASES = "logical_agent_connector_leases"
TENANT = "planted"
GOOD = {"endpoint": "10.0.0.7:8443", "zone": 'eu "west" ü 東京'}
# What a gateway role could store before 0010, none of which a library write can.
PLANTED: dict[str, object] = {
    "non-string value": {"endpoint": 8443},
    "nested object": {"endpoint": {"host": "10.0.0.7", "port": "8443"}},
    "escape in value": {"endpoint": "\x1b[2J\x1b[31mowned\x1b[0m"},
    "escape in key": {"\x1b]0;owned\x07": "10.0.0.7:8443"},
    "bad key": {"end point": "10.0.0.7:8443"},
}
# Each planted by a takeover-shaped write over a row acquired through the library.
PLANTED_BY_TAKEOVER = {"bell by takeover": {"endpoint": "ring\x07ring"}}
ALL_PLANTED = {**PLANTED, **PLANTED_BY_TAKEOVER}
CONTROL = ("\x1b", "\x07", "\x9b")
METADATA_WITHHELD = "<invalid: withheld>"  # what `mos-lease status` shows (docs/gateway.md)

_INSERT = ("WITH t AS (SELECT clock_timestamp() AS now) INSERT INTO {} (tenant_id,"
           " logical_agent_id, binding_id, lease_id, connector_id, allowed_scopes, epoch,"
           " acquired_at, heartbeat_at, expires_at, released_at, updated_at, holder_metadata)"
           " SELECT %s, 'agent', %s, gen_random_uuid(), 'c1', ARRAY['tool:run'], 1, t.now,"
           " t.now, t.now + interval '1 minute', NULL, t.now, %s::jsonb FROM t")
_TAKEOVER = ("WITH t AS (SELECT clock_timestamp() AS now) UPDATE {} SET epoch = epoch + 1,"
             " lease_id = gen_random_uuid(), connector_id = 'c2', acquired_at = t.now,"
             " heartbeat_at = t.now, expires_at = t.now + interval '1 minute',"
             " updated_at = t.now, holder_metadata = %s::jsonb FROM t"
             " WHERE tenant_id = %s AND binding_id = %s")


def _binding(name: str) -> str:
    return name.replace(" ", "-")


def _plant_insert(conn: psycopg.Connection[Any], schema: str, tenant: str, binding: str,
                  metadata: object) -> None:
    conn.execute(sql.SQL(_INSERT).format(sql.Identifier(schema, LEASES)),
                 (tenant, binding, json.dumps(metadata)))


def _plant_takeover(conn: psycopg.Connection[Any], schema: str, tenant: str, binding: str,
                    metadata: object) -> None:
    conn.execute(sql.SQL(_TAKEOVER).format(sql.Identifier(schema, LEASES)),
                 (json.dumps(metadata), tenant, binding))


def _stored(conn: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    return conn.execute(sql.SQL("SELECT * FROM {} ORDER BY tenant_id, binding_id").format(
        sql.Identifier(schema, LEASES))).fetchall()


@pytest.fixture(scope="module")
def upgraded(pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> Iterator[
        tuple[Layout, list[tuple[Any, ...]]]]:
    """A schema with owner and gateway roles built at version 9, populated by the library
    (good metadata, none) and by the gateway role's own SQL (every payload of
    :data:`ALL_PLANTED`), then migrated in place to the newest version; with the rows as
    they stood before the migration."""
    names = {"owner_role": unique_name("mos_lease_owner"),
             "gateway_role": unique_name("mos_lease_gateway"),
             "schema_name": unique_name("mos_lease")}
    schema = names["schema_name"]
    owner_dsn = with_params(pg_dsn, user=names["owner_role"])
    gateway_dsn = with_params(pg_dsn, user=names["gateway_role"])
    layout = Layout(names["owner_role"], names["gateway_role"], schema, owner_dsn, gateway_dsn)
    try:
        apply_roles_file(pg_dsn, pg_admin, names)
        with psycopg.connect(owner_dsn, autocommit=True) as conn:
            migrations_module._ensure_bookkeeping(conn, schema)
            for migration in migrations_module.available_migrations()[:9]:
                migrations_module._apply(conn, schema, migration, True)
        apply_roles_file(pg_dsn, pg_admin, names)  # the grants on the tables now there
        with psycopg.connect(gateway_dsn, autocommit=True) as conn:
            # The library of version 9 wrote these (its statements, not a store: a store of
            # this build wants the newest schema).
            _plant_insert(conn, schema, TENANT, "good", GOOD)
            _plant_insert(conn, schema, TENANT, "none", {})
            for name, metadata in PLANTED.items():
                _plant_insert(conn, schema, TENANT, _binding(name), metadata)
            for name, metadata in PLANTED_BY_TAKEOVER.items():
                _plant_insert(conn, schema, TENANT, _binding(name), GOOD)
                _plant_takeover(conn, schema, TENANT, _binding(name), metadata)
            before = _stored(conn, schema)
        assert migrate(owner_dsn, schema=schema, allow_second_copy=True) == [10, 11]
        yield layout, before
    finally:
        pg_admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
            sql.Identifier(schema)))
        for role in (names["gateway_role"], names["owner_role"]):
            if pg_admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s",
                                (role,)).fetchone() is not None:
                pg_admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                pg_admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _store(layout: Layout) -> PostgresLeaseStore:
    return PostgresLeaseStore(layout.gateway_dsn,
                              settings=ConnectionSettings(schema=layout.schema))


def _ident(name: str) -> LeaseIdentity:
    return LeaseIdentity(TENANT, "agent", _binding(name))


# -- version 9 took them; 0010 keeps them -------------------------------------------------


def test_version_9_stored_every_planted_payload_and_the_upgrade_kept_every_row(
        upgraded: tuple[Layout, list[tuple[Any, ...]]]) -> None:
    layout, before = upgraded
    stored = {row[2]: row[-1] for row in before}
    assert stored == {"good": GOOD, "none": {},
                      **{_binding(name): value for name, value in ALL_PLANTED.items()}}
    with psycopg.connect(layout.owner_dsn, autocommit=True) as conn:
        assert _stored(conn, layout.schema) == before  # no row changed, none went
        flagged = conn.execute(sql.SQL(
            "SELECT binding_id FROM {} WHERE {}(holder_metadata) IS NOT NULL"
            " ORDER BY binding_id").format(
                sql.Identifier(layout.schema, LEASES),
                sql.Identifier(layout.schema, "mos_lease_metadata_problem"))).fetchall()
    # The query the migration documents finds exactly the planted rows.
    assert [b for (b,) in flagged] == sorted(_binding(name) for name in ALL_PLANTED)


# -- the library withholds them on every read ---------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL_PLANTED))
def test_current_holder_withholds_planted_metadata(
        upgraded: tuple[Layout, list[tuple[Any, ...]]], name: str,
        caplog: pytest.LogCaptureFixture) -> None:
    layout, _ = upgraded
    epoch = 2 if name in PLANTED_BY_TAKEOVER else 1
    with _store(layout) as store, caplog.at_level(logging.WARNING, "mos_lease.metadata"):
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        views = [gateway.current_holder(_ident(name)) for _ in range(3)]
        refused = gateway.acquire(_ident(name), "c9", scopes=[], ttl=30,
                                  metadata={"endpoint": "x:1"})
    for view in [*views, refused.holder]:
        assert view is not None
        assert view.metadata == {} and view.metadata_invalid
        assert (view.connector_id, view.epoch) == ("c2" if epoch == 2 else "c1", epoch)
    assert not refused.ok
    # One WARNING for the lease, however often it is read (no earlier test of this module
    # read it), naming it, and with no raw control character.
    warnings = [r for r in caplog.records if r.name == "mos_lease.metadata"]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    message = warnings[0].getMessage()
    assert repr(_binding(name)) in message and "withheld" in message
    assert not any(c in message for c in CONTROL)


def test_good_metadata_reads_as_it_was_set_and_warns_nothing(
        upgraded: tuple[Layout, list[tuple[Any, ...]]],
        caplog: pytest.LogCaptureFixture) -> None:
    layout, _ = upgraded
    with _store(layout) as store, caplog.at_level(logging.WARNING, "mos_lease.metadata"):
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        good, none = gateway.current_holder(_ident("good")), gateway.current_holder(
            _ident("none"))
    assert good is not None and (good.metadata, good.metadata_invalid) == (GOOD, False)
    assert none is not None and (none.metadata, none.metadata_invalid) == ({}, False)
    assert not [r for r in caplog.records if r.name == "mos_lease.metadata"]


def test_status_shows_a_marker_and_no_control_character(
        upgraded: tuple[Layout, list[tuple[Any, ...]]],
        capsys: pytest.CaptureFixture[str]) -> None:
    layout, _ = upgraded
    assert run("status", "--dsn", layout.gateway_dsn, "--schema", layout.schema,
               "--tenant", TENANT) == 0
    text = capsys.readouterr().out
    assert not any(c in text for c in CONTROL)
    cells = {line.split()[2]: line for line in text.splitlines()[2:]}
    for name in ALL_PLANTED:
        assert cells[_binding(name)].endswith(METADATA_WITHHELD), cells[_binding(name)]
    assert cells["good"].endswith(json.dumps(GOOD, ensure_ascii=False, separators=(",", ":")))
    assert cells["none"].endswith(" -")

    assert run("status", "--dsn", layout.gateway_dsn, "--schema", layout.schema,
               "--tenant", TENANT, "--json") == 0
    raw = capsys.readouterr().out
    assert "\\u001b" not in raw and "\\u0007" not in raw  # not even escaped
    leases = {lease["binding_id"]: lease for lease in json.loads(raw)["leases"]}
    for name in ALL_PLANTED:
        assert leases[_binding(name)]["metadata"] == {}
        assert leases[_binding(name)]["metadata_invalid"] is True
    assert (leases["good"]["metadata"], leases["good"]["metadata_invalid"]) == (GOOD, False)


def _handle(layout: Layout, name: str) -> LeaseHandle:
    with psycopg.connect(layout.owner_dsn, autocommit=True) as conn:
        found = conn.execute(sql.SQL(
            "SELECT lease_id, connector_id, epoch, allowed_scopes, expires_at FROM {}"
            " WHERE tenant_id = %s AND binding_id = %s").format(
                sql.Identifier(layout.schema, LEASES)), (TENANT, _binding(name))).fetchone()
    assert found is not None
    lease_id, connector, epoch, scopes, expires = found
    expires_at: datetime = expires
    return LeaseHandle(_ident(name), connector, lease_id, epoch, tuple(scopes), expires_at)


@pytest.mark.parametrize("name", ["escape in key", "non-string value"])
def test_every_lease_operation_works_on_such_a_row(
        upgraded: tuple[Layout, list[tuple[Any, ...]]], name: str) -> None:
    layout, _ = upgraded
    lease = _handle(layout, name)
    with _store(layout) as store:
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        renewed = gateway.heartbeat(lease, ttl=30)
        assert renewed.ok and renewed.lease is not None
        assert gateway.heartbeat_many([renewed.lease], ttl=30)[0].ok
        grant = gateway.issue_grant(renewed.lease, scopes=["tool:run"], ttl=10)
        assert grant.grant is not None
        assert gateway.validate(grant.grant, identity=lease.identity, scopes=["tool:run"]).ok
        assert gateway.release(renewed.lease).ok
        view = gateway.current_holder(lease.identity)
        assert view is not None and view.state is LeaseState.RELEASED and view.metadata_invalid
        # A takeover replaces the planted metadata; the row reads clean from then on.
        taken = gateway.takeover(lease.identity, "c3", scopes=[], ttl=30,
                                 expected_epoch=lease.epoch, observed=view,
                                 metadata={"endpoint": "10.0.0.9:8443"})
        assert taken.ok
        view = gateway.current_holder(lease.identity)
        assert view is not None and not view.metadata_invalid
        assert view.metadata == {"endpoint": "10.0.0.9:8443"}


# -- from 0010 on the database refuses them ---------------------------------------------


@pytest.mark.parametrize("role", ["gateway", "owner"])
@pytest.mark.parametrize("name", sorted(ALL_PLANTED))
def test_the_database_refuses_new_ones(upgraded: tuple[Layout, list[tuple[Any, ...]]],
                                       role: str, name: str) -> None:
    layout, _ = upgraded
    dsn = layout.gateway_dsn if role == "gateway" else layout.owner_dsn
    binding = f"new-{role}-{_binding(name)}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = _stored(conn, layout.schema)
        with pytest.raises(errors.CheckViolation, match=r"INSERT .* refused: .*holder metadata"):
            _plant_insert(conn, layout.schema, TENANT, binding, ALL_PLANTED[name])
        _plant_insert(conn, layout.schema, TENANT, binding, GOOD)
        held = _stored(conn, layout.schema)
        with pytest.raises(errors.CheckViolation, match=r"UPDATE .* refused: .*holder metadata"):
            _plant_takeover(conn, layout.schema, TENANT, binding, ALL_PLANTED[name])
        assert _stored(conn, layout.schema) == held and len(held) == len(before) + 1


def test_through_the_library_a_good_payload_still_goes_in(
        upgraded: tuple[Layout, list[tuple[Any, ...]]]) -> None:
    layout, _ = upgraded
    ident = LeaseIdentity(TENANT, "agent", "library")
    with _store(layout) as store:
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        assert gateway.acquire(ident, "c1", scopes=[], ttl=30, metadata=GOOD).ok
        assert gateway.takeover(ident, "c2", scopes=[], ttl=30, expected_epoch=1,
                                metadata={"endpoint": "a:1"}).ok
        assert gateway.current_holder(ident).metadata == {"endpoint": "a:1"}  # type: ignore[union-attr]


# -- the database's rule gives the library's verdicts --------------------------------------


def _assigned(cp: int) -> bool:
    return unicodedata.category(chr(cp)) not in ("Cn", "Cs")


# Every assigned code point of the Basic Multilingual Plane and of the format, control,
# separator and private-use categories anywhere, plus every 7th assigned one above.
CODE_POINTS = sorted({cp for cp in range(1, 0x10000) if _assigned(cp)}
                     | {cp for cp in range(0x10000, 0x110000, 7) if _assigned(cp)}
                     | {cp for cp in range(0x10000, 0x110000)
                        if unicodedata.category(chr(cp)) in ("Cc", "Cf", "Zs", "Zl", "Zp")}
                     | {0xF0000, 0xFFFFD, 0x100000, 0x10FFFD})

STRUCTURE: list[object] = [
    {}, GOOD, {"k": ""}, {"a" * 64: "v"}, {"a" * 65: "v"}, {"": "v"}, {"k-._9": "v"},
    {"k/": "v"}, {"kü": "v"}, {"k\n": "v"}, {"k": "v" * 512}, {"k": "v" * 513},
    {"k": "ü" * 512}, {f"k{i}": "v" for i in range(16)}, {f"k{i}": "v" for i in range(17)},
    {f"k{i:02d}": "v" * 125 for i in range(16)},  # 2,048 bytes exactly
    {f"k{i:02d}": "v" * 125 + ("v" if i == 0 else "") for i in range(16)},  # 2,049
    {f"k{i:02d}": "ü" * 62 + "v" for i in range(16)},  # 2,048 bytes of two-byte letters
    {f"k{i:02d}": "ü" * 63 for i in range(16)},  # 2,064
    {"k": 1}, {"k": 1.5}, {"k": True}, {"k": None}, {"k": ["v"]}, {"k": {"v": "w"}},
    ["k"], "k", 1, None,
]


def _library_refuses(value: object) -> bool:
    try:
        check_metadata("metadata", value)
    except InvalidInput:
        return True
    return False


def _database_refuses(layout: Layout, values: list[object]) -> list[bool]:
    with psycopg.connect(layout.owner_dsn, autocommit=True) as conn:
        rows = conn.execute(sql.SQL(
            "SELECT {}(v::jsonb) IS NOT NULL FROM unnest(%s::text[]) WITH ORDINALITY AS u(v, i)"
            " ORDER BY i").format(sql.Identifier(layout.schema, "mos_lease_metadata_problem")),
            ([json.dumps(v) for v in values],)).fetchall()
    return [refused for (refused,) in rows]


def test_the_database_and_the_library_judge_the_same_structures(
        upgraded: tuple[Layout, list[tuple[Any, ...]]]) -> None:
    layout, _ = upgraded
    # Not JSON null: the library takes None for "no metadata", and the column cannot hold
    # a JSON null (0007's CHECK: an object).
    values = [v for v in STRUCTURE if v is not None]
    assert _database_refuses(layout, values) == [_library_refuses(v) for v in values]


def test_the_database_and_the_library_judge_the_same_characters(
        upgraded: tuple[Layout, list[tuple[Any, ...]]]) -> None:
    layout, _ = upgraded
    values: list[object] = [{"k": f"a{chr(cp)}b"} for cp in CODE_POINTS]
    expected = [not chr(cp).isprintable() for cp in CODE_POINTS]
    got = _database_refuses(layout, values)
    differ = [hex(cp) for cp, e, g in zip(CODE_POINTS, expected, got, strict=True) if e != g]
    assert differ == [] and len(got) > 60_000


# -- `mos-lease check` counts them -----------------------------------------------------------


def test_check_counts_the_rows_whose_metadata_is_withheld(
        upgraded: tuple[Layout, list[tuple[Any, ...]]]) -> None:
    layout, _ = upgraded
    with psycopg.connect(layout.owner_dsn, autocommit=True) as conn:
        found = conn.execute(sql.SQL(
            "SELECT count(*) FROM {} WHERE {}(holder_metadata) IS NOT NULL").format(
                sql.Identifier(layout.schema, LEASES),
                sql.Identifier(layout.schema, "mos_lease_metadata_problem"))).fetchone()
    assert found is not None and found[0] >= 1
    report, code = run_check(layout.gateway_dsn, layout.schema)  # as the gateway role
    item = {i.name: i for i in report.items}["holder_metadata"]
    assert item.status is Status.WARN and item.value.startswith(f"{found[0]} lease row(s)")
    assert item.fix is not None and "mos_lease_metadata_problem" in item.fix
    assert code == report.exit_code  # a warning, not a problem of its own


def test_check_judges_the_count() -> None:
    clock = ClockReading(0.0, 0.001)
    facts = Facts(schema="mos_lease", server_version_num=150000, server_version="15",
                  role="gw", database="db", schema_check=None, schema_error="not read",
                  synchronous_commit="on", synchronous_standby_names="", in_recovery=False,
                  statement_timeout="5s", lock_timeout="2s", clock=clock, client_port=5432,
                  server_port=5432, backend_pids=(1,))

    def item(withheld: int | None) -> list[tuple[str, Status]]:
        report = evaluate(attrs.evolve(facts, metadata_withheld=withheld))
        return [(i.name, i.status) for i in report.items if i.name == "holder_metadata"]

    assert item(None) == []
    assert item(0) == [("holder_metadata", Status.OK)]
    assert item(3) == [("holder_metadata", Status.WARN)]
