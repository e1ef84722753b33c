"""``mos-lease status --fleet NAME`` on PostgreSQL, over a fleet of three real thread
supervisors in this process (each with its own store connection): the members with their
endpoints, epochs and expiries, each member's share, and the bindings last held by a member
that no one holds now, checked against the rows read apart; in one statement; text and
JSON; a fleet that does not exist and bad input answered with a clear message and an exit
code."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import datetime

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, InvalidInput, LeaseIdentity
from mos_lease.fleet.members import member_identity
from mos_lease.fleet.membership import Fleet
from mos_lease.supervisor import Supervisor
from mos_lease.vocabulary import Outcome
from mos_lease_pg import AsyncPostgresLeaseStore
from tests.fleet_check import MemberRig
from tests.pg_fixtures import StoreFactory
from tests.pg_fixtures import run_cli as run

pytestmark = pytest.mark.pg

TTL, LOOK, GRACE = 4.0, 0.5, 2.0
BINDINGS = 60


class Rig(MemberRig):
    """Three members of fleet ``tenant`` (member names unique to the test: the database is
    shared by the run, and a member's bindings are found by its connector id)."""

    def __init__(self, stores: StoreFactory, dsn: str, tenant: str, stack: ExitStack) -> None:
        super().__init__(ConnectorLeaseCoordinator(stores(), AllowAllPolicy()),
                         [LeaseIdentity(tenant, f"agent-{n}", "main") for n in range(BINDINGS)],
                         TTL, stack)
        self.stores, self.dsn, self.tenant = stores, dsn, tenant
        self.names = [f"{tenant}-m{n}" for n in (1, 2, 3)]

    def start(self, name: str) -> Supervisor:
        return self.join(name, Supervisor(
            ConnectorLeaseCoordinator(self.stores(), AllowAllPolicy()),
            fleet=Fleet(self.tenant, name, members=self.names, ttl=TTL, look=LOOK,
                        grace=GRACE, endpoint=f"{name}.internal:8443")))


@pytest.fixture
def rig(pg_stores: StoreFactory, pg_dsn: str, pg_tenant: str) -> Iterator[Rig]:
    with ExitStack() as stack:
        yield Rig(pg_stores, pg_dsn, pg_tenant, stack)


def balanced(names: set[str]) -> Callable[[Counter[str | None]], bool]:
    cap = math.ceil(1.1 * BINDINGS / len(names))
    return lambda shares: set(shares) == names and max(shares.values()) <= cap


def counts_agree_with_the_audit_log(rig: Rig, members: list[Supervisor]) -> None:
    """What the members report of themselves agrees with the audit log: every takeover
    written was won by a member, as a hand-off in (the lease was released: planned
    hand-offs, a member leaving), none of an expired lease; each hand-off out was taken
    in."""
    found = [s.fleet_status() for s in members]
    statuses = [s for s in found if s is not None]
    assert len(statuses) == len(members)
    written = sum(r.entry.outcome is Outcome.TAKEN_OVER
                  for b in rig.bindings for r in rig.reader.store.audit(b))  # type: ignore[attr-defined]
    assert written == sum(s.hand_offs_in for s in statuses) > 0
    assert sum(s.takeovers for s in statuses) == 0
    assert sum(s.hand_offs for s in statuses) <= written


def test_status_fleet_shows_members_shares_and_bindings_no_one_holds(
        rig: Rig, pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    m1, m2, m3 = rig.names
    for name in rig.names:
        rig.start(name)
    rig.wait_for(balanced(set(rig.names)), 20)
    leaving = rig.running.pop(m3)
    leaving.close()  # leaves: its member lease is released
    shares = rig.wait_for(balanced({m1, m2}), 10)
    counts_agree_with_the_audit_log(rig, [*rig.running.values(), leaving])
    # Three bindings no supervisor runs, last held by m1's connector and released, oldest
    # first; one held by a connector outside the fleet; and another fleet's member lease
    # under the same member name: none of these may count as a share.
    hand = ConnectorLeaseCoordinator(rig.stores(), AllowAllPolicy())
    loose = [LeaseIdentity(rig.tenant, f"loose-{n}", "main") for n in range(3)]
    for identity in loose:
        lease = hand.acquire(identity, m1, scopes=[], ttl=60).lease
        assert lease is not None and hand.release(lease).ok
        time.sleep(0.01)
    assert hand.acquire(LeaseIdentity(rig.tenant, "outsider", "main"), "not-a-member",
                        scopes=[], ttl=60).ok
    assert hand.acquire(member_identity(f"{rig.tenant}-other", m1), m1, scopes=[],
                        ttl=60).ok
    shares = rig.shares()  # as close to the command's read as can be
    members = dict(zip(rig.names, rig.reader.current_holders(
        [member_identity(rig.tenant, n) for n in rig.names]), strict=True))

    assert run("status", "--dsn", pg_dsn, "--fleet", rig.tenant, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fleet"] == rig.tenant
    got = {m["member"]: m for m in report["members"]}
    assert list(got) == rig.names
    for name, view in members.items():
        assert view is not None
        shown = got[name]
        assert (shown["connector_id"], shown["endpoint"], shown["epoch"]) == (
            name, f"{name}.internal:8443", view.epoch)
        assert shown["live"] is (name != m3)
        assert shown["state"] == ("released" if name == m3 else "active")
        if name == m3:  # released: its expiry no longer moves
            assert datetime.fromisoformat(shown["expires_at"]) == view.expires_at
    held = {name: got[name]["held"] for name in rig.names}
    # Every binding stays held through the run; between the two reads a late hand-off
    # may still move one or two from one member to the other.
    assert held[m3] == 0 and held[m1] + held[m2] == BINDINGS == report["held"]
    assert abs(held[m1] - shares[m1]) <= 2
    unheld = report["unheld"]
    assert unheld["count"] == 3
    assert [(b["logical_agent_id"], b["member"], b["state"]) for b in unheld["oldest"]] == [
        (i.logical_agent_id, m1, "released") for i in loose]
    assert unheld["oldest_since"] == unheld["oldest"][0]["since"]
    assert unheld["oldest_for_seconds"] >= unheld["oldest"][-1]["for_seconds"] >= 0

    assert run("status", "--dsn", pg_dsn, "--fleet", rig.tenant, "--show", "1") == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith(f"fleet {rig.tenant} at database time ")
    assert f"2 of 3 member(s) live; {BINDINGS} binding(s) held, 3 without a holder" in text[0]
    assert text[1].split() == ["MEMBER", "STATE", "ENDPOINT", "EPOCH", "EXPIRES", "HELD"]
    rows = {line.split()[0]: line.split() for line in text[2:5]}
    assert rows[m3][1:3] == ["released", f"{m3}.internal:8443"] and rows[m3][-1] == "0"
    assert rows[m1][1] == "live" and rows[m2][1] == "live"
    assert int(rows[m1][-1]) + int(rows[m2][-1]) == BINDINGS
    assert text[5] == "without a holder, the oldest 1 of 3:"
    assert text[7].split()[:6] == [rig.tenant, "loose-0", "main", m1, "1", "released"]
    assert len(text) == 8


def test_the_fleet_is_read_in_one_statement(rig: Rig) -> None:
    rig.start(rig.names[0])
    rig.wait_for(lambda s: s == {rig.names[0]: BINDINGS}, 20)
    store = rig.stores()
    before = store.stats().round_trips_total
    now, rows = store.fleet_leases(rig.tenant)
    assert store.stats().round_trips_total - before == 1
    assert len(rows) == BINDINGS + 1 and now.tzinfo is not None
    # Narrowed to another tenant: the member lease, no binding.
    _now, narrowed = store.fleet_leases(rig.tenant, tenant_id="nobody")
    assert [r.identity for r in narrowed] == [member_identity(rig.tenant, rig.names[0])]
    for fleet, tenant in (("", None), ("edge\x00", None), (rig.tenant, "")):
        with pytest.raises(InvalidInput):
            store.fleet_leases(fleet, tenant_id=tenant)


def test_a_fleet_that_does_not_exist_is_a_clear_error(
        pg_dsn: str, pg_tenant: str, capsys: pytest.CaptureFixture[str]) -> None:
    for extra in ((), ("--json",)):
        assert run("status", "--dsn", pg_dsn, "--fleet", f"{pg_tenant}-none", *extra) == 1
        out, err = capsys.readouterr()
        assert out == ""
        assert f"no member of fleet '{pg_tenant}-none' has ever held its member lease" in err
        assert "'mos-lease.fleet'" in err


@pytest.mark.parametrize(("argv", "message"), [
    (("--fleet", ""), "fleet name '': must not be empty"),
    (("--fleet", "edge\n"), "fleet name 'edge\\n'"),
    (("--fleet", "x" * 300), "fleet name"),
    (("--fleet", "edge", "--show", "-1"), "'-1': must be a whole number from 0 to 1000"),
    (("--fleet", "edge", "--show", "1001"), "from 0 to 1000"),
    (("--fleet", "edge", "--show", "ten"), "'ten': must be a whole number"),
])
def test_bad_input_is_refused_before_anything_is_read(
        pg_dsn: str, argv: tuple[str, ...], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        run("status", "--dsn", pg_dsn, *argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_tenant_with_a_fleet_is_a_clear_error(
        pg_dsn: str, pg_tenant: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("status", "--dsn", pg_dsn, "--fleet", pg_tenant, "--tenant", " x") == 1
    out, err = capsys.readouterr()
    assert out == "" and "tenant_id" in err


def test_an_unreachable_database_is_a_clear_error(
        pg_tenant: str, capsys: pytest.CaptureFixture[str]) -> None:
    dsn = "host=127.0.0.1 port=1 dbname=none connect_timeout=2"
    assert run("status", "--dsn", dsn, "--fleet", pg_tenant) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("mos-lease: ")


def test_the_asyncio_store_reads_the_same_rows(rig: Rig, pg_dsn: str) -> None:
    rig.start(rig.names[0])
    rig.wait_for(lambda s: s == {rig.names[0]: BINDINGS}, 20)
    _now, rows = rig.stores().fleet_leases(rig.tenant)

    async def read() -> list[LeaseIdentity]:
        async with AsyncPostgresLeaseStore(pg_dsn) as store:
            _at, found = await store.fleet_leases(rig.tenant)
            with pytest.raises(InvalidInput):
                await store.fleet_leases("")
            return [r.identity for r in found]

    assert asyncio.run(read()) == [r.identity for r in rows]
