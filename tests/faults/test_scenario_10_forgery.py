"""Scenario 10: forgery -> 0 of at least 20 ways to fake or smuggle a grant accepted.

Every way yields an object that is presented to the gateway twice, through ``validate`` and
through ``invoke`` (whose adapter must then never run). A genuine grant, presented the same
way, is accepted: the positive control that shows an acceptance would be seen. A way that
cannot even produce its object (copying and pickling raise ``GrantNotTransferable``) counts
as refused.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import io
import json
import os
import pickle
import types
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    ExecutionGrant,
    LeaseHandle,
    LeaseIdentity,
)
from mos_lease.errors import GrantNotTransferable
from mos_lease_memory import InMemoryLeaseStore
from tests.faults.gateway import SCOPES, Gateway
from tests.faults.history import Op, check_history, read_records
from tests.faults.replicas import grant_fields as _grant_fields
from tests.faults.replicas import replica
from tests.faults.support import Table, Worker, audit_rows, final_rows, run_prefix

pytestmark = [pytest.mark.faults, pytest.mark.pg]

FIELDS = ("grant_id", "identity", "connector_id", "lease_id", "epoch", "scopes", "expires_at",
          "correlation_id", "_mac")


class _Forge:
    """Makes grants on a real lease to build forgeries from."""

    def __init__(self, gw: Gateway, identity: LeaseIdentity,
                 lease: LeaseHandle | None = None) -> None:
        self.gw = gw
        if lease is None:
            got = gw.acquire(identity, ttl=120)
            assert got is not None and got.lease is not None
            lease = got.lease
        self.lease: LeaseHandle = lease
        self.identity = identity

    def grant(self) -> ExecutionGrant:
        granted = self.gw.issue_grant(self.lease, ttl=25)
        assert granted is not None and granted.grant is not None
        return granted.grant


def _mutated(grant: ExecutionGrant, **changes: Any) -> ExecutionGrant:
    """The genuine object itself, with fields overwritten in place."""
    for name, value in changes.items():
        object.__setattr__(grant, name, value)
    return grant


def _rebuilt(cls: type, grant: ExecutionGrant) -> Any:
    obj: Any = object.__new__(cls)
    for name in FIELDS:
        object.__setattr__(obj, name, getattr(grant, name))
    return obj


class _SubGrant(ExecutionGrant):
    """A subclass that an attacker might hope passes an isinstance check."""


def _copyreg_round_trip(grant: ExecutionGrant) -> Any:
    # A dispatch-table reducer is consulted before the class's own __reduce_ex__.
    table = copyreg.dispatch_table.copy()
    table[ExecutionGrant] = lambda g: (replica, (_grant_fields(g),))
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer)
    pickler.dispatch_table = table
    pickler.dump(grant)
    return pickle.loads(buffer.getvalue())


class _OverridePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is ExecutionGrant:
            return replica, (_grant_fields(obj),)
        return NotImplemented


def _reducer_override_round_trip(grant: ExecutionGrant) -> Any:
    buffer = io.BytesIO()
    _OverridePickler(buffer).dump(grant)
    return pickle.loads(buffer.getvalue())


def _fork_and_validate(coordinator: ConnectorLeaseCoordinator, grant: ExecutionGrant,
                       identity: LeaseIdentity) -> bool:
    """Present the parent's genuine grant to the (inherited) coordinator in a forked child;
    True if the child saw it accepted or its adapter run."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no cleanup, no shared-socket use, just an answer
        try:
            ran = []
            checked = coordinator.validate(grant, identity=identity, scopes=SCOPES)
            invoked = coordinator.invoke(grant, lambda ctx: ran.append(1), identity=identity,
                                         scopes=SCOPES)
            answer = b"1" if checked.ok or invoked.ok or ran else b"0"
        except BaseException:
            answer = b"E"
        os.write(write, answer)
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer in (b"0", b"1"), f"forked child failed: {answer!r}"
    return answer == b"1"


def _fork_mint(gw: Gateway) -> dict[str, Any]:
    """A forked child that re-acquires nothing but can still call the inherited coordinator:
    it tries to mint, and if it could, hands every byte of the grant back to the parent."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            # The child must not touch the parent's connection: it builds its own store.
            from mos_lease_pg import PostgresLeaseStore

            store = PostgresLeaseStore(gw.cfg["dsn"])
            child = ConnectorLeaseCoordinator(store, AllowAllPolicy())
            got = child.acquire(LeaseIdentity(gw.cfg["fork_tenant"], "forked", "child"), "fork",
                                scopes=SCOPES, ttl=60)
            assert got.lease is not None
            granted = child.issue_grant(got.lease, scopes=SCOPES, ttl=25)
            assert granted.grant is not None
            os.write(write, json.dumps(_grant_fields(granted.grant)).encode())
            store.close()
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    fields: dict[str, Any] = json.loads(data)
    return fields


def test_forgery(pg_dsn: str, admin: psycopg.Connection[Any], figures: Table,
                 tmp_path: Path) -> None:
    prefix = run_prefix("s10")
    gw = Gateway({"dsn": pg_dsn, "process": "gateway", "connector": "gw",
                  "fork_tenant": run_prefix("s10f"),
                  "records": str(tmp_path / "gateway.jsonl")})
    other = Gateway({"dsn": pg_dsn, "process": "other", "connector": "gw",
                     "records": str(tmp_path / "other.jsonl")})
    mine = LeaseIdentity(prefix, "agent", "mine")
    forge = _Forge(gw, mine)
    # A second gateway instance minting for the very same lease (a handle is plain data).
    elsewhere = _Forge(other, mine, forge.lease)
    second = _Forge(gw, LeaseIdentity(prefix, "agent", "second"))
    adapter_runs: list[str] = []
    results: dict[str, tuple[bool, str]] = {}

    def present(way: str, make: Callable[[], Any]) -> None:
        """Make the forgery, then validate and invoke it on the real gateway."""
        try:
            obj = make()
        except GrantNotTransferable as exc:
            results[way] = (False, f"cannot be made: {type(exc).__name__}")
            return
        validated = gw.validate(obj, identity=mine) if isinstance(obj, ExecutionGrant) \
            else _present(gw, obj, mine, None)
        invoked = _present(gw, obj, mine, lambda ctx: adapter_runs.append(way))
        accepted = bool(validated is not None and validated.ok) \
            or bool(invoked is not None and invoked.ok) or way in adapter_runs
        reason = validated.reason if validated is not None else "error"
        results[way] = (accepted, f"{reason}")

    ways = _ways(gw, forge, elsewhere, second, mine, pg_dsn)
    control = forge.grant()
    present("genuine grant (positive control)", lambda: control)
    for way, make in ways.items():
        present(way, make)
    # A restarted gateway: a new coordinator on the same store; the old grant object.
    old = forge.grant()
    gw.coordinator = ConnectorLeaseCoordinator(gw.store, AllowAllPolicy())
    present("grant from before a gateway restart", lambda: old)
    # A forked child presenting the parent's genuine grant to the inherited coordinator.
    fresh = forge.grant()
    forked_ok = _fork_and_validate(gw.coordinator, fresh, mine)
    results["genuine grant used in a forked child"] = (forked_ok, "grant_unknown"
                                                       if not forked_ok else "accepted")
    results["byte-exact replicas in another process (5)"] = _smuggle(pg_dsn, tmp_path, forge)
    gw.close()
    other.close()

    records = read_records(tmp_path.glob("*.jsonl"))
    violations = check_history(records, audit_rows(admin, prefix),
                               final_rows=final_rows(admin, prefix))
    control_ok, _ = results.pop("genuine grant (positive control)")
    accepted = [way for way, (ok, _) in results.items() if ok]
    figures.add("ways to fake or smuggle a grant", len(results), ">= 20", len(results) >= 20)
    figures.add("positive control: genuine grant accepted", control_ok, "True", control_ok)
    figures.add("forgeries accepted (validate or invoke)", len(accepted), "0", not accepted)
    figures.add("adapter runs for forgeries", len([w for w in adapter_runs
                                                   if not w.startswith("genuine")]), "0",
                all(w.startswith("genuine") for w in adapter_runs))
    figures.add("history checker violations", len(violations), "0", not violations)
    for way, (ok, why) in results.items():
        figures.notes.append(f"{'ACCEPTED' if ok else 'refused'}: {way} ({why})")
    assert not figures.failed(), figures.render()


def _smuggle(pg_dsn: str, tmp_path: Path, forge: _Forge) -> tuple[bool, str]:
    """Another OS process is handed every byte of five genuine grants; (accepted, note)."""
    dump = tmp_path / "grants.json"
    dump.write_text("\n".join(json.dumps(_grant_fields(forge.grant())) for _ in range(5)))
    worker = Worker("smuggle", {"dsn": pg_dsn, "process": "smuggler", "connector": "gw",
                                "dump": str(dump), "records": str(tmp_path / "smuggler.jsonl")},
                    tmp_path)
    try:
        smuggled = worker.finish(60)
    finally:
        worker.kill()
    return int(smuggled["accepted"]) > 0, f"{smuggled['tried']} tried"


_KEEP: list[Any] = []


def _keep(obj: Any) -> Any:
    _KEEP.append(obj)  # a weak proxy needs its referent alive
    return obj


def _present(gw: Gateway, obj: Any, identity: LeaseIdentity,
             adapter: Callable[[ConnectorExecutionContext], Any] | None) -> Any:
    """Validate (``adapter`` None) or invoke ``obj``, recorded as a validation."""
    corr = gw.corr("forged")
    key = obj.correlation_id if isinstance(obj, ExecutionGrant) else None

    def call() -> Any:
        if adapter is None:
            return gw.coordinator.validate(obj, identity=identity, scopes=SCOPES,
                                           correlation_id=corr)
        return gw.coordinator.invoke(obj, adapter, identity=identity, scopes=SCOPES,
                                     correlation_id=corr)

    connector = obj.connector_id if isinstance(obj, ExecutionGrant) else "unrecognized"
    result, _ = gw.rec.call(Op.VALIDATE, identity, connector, corr, call, audit_key=key)
    return result


def _async_grant(dsn: str, prefix: str) -> ExecutionGrant:
    import asyncio

    from mos_lease_pg import AsyncPostgresLeaseStore

    async def mint() -> ExecutionGrant:
        store = AsyncPostgresLeaseStore(dsn)
        try:
            coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            identity = LeaseIdentity(prefix, "agent", "a")
            got = await coordinator.acquire(identity, "gw", scopes=SCOPES, ttl=60)
            assert got.lease is not None
            granted = await coordinator.issue_grant(got.lease, scopes=SCOPES, ttl=25)
            assert granted.grant is not None
            return granted.grant
        finally:
            await store.aclose()

    return asyncio.run(mint())


def _memory_grant() -> ExecutionGrant:
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    identity = LeaseIdentity("memory", "agent", "mine")
    got = coordinator.acquire(identity, "gw", scopes=SCOPES, ttl=60)
    assert got.lease is not None
    granted = coordinator.issue_grant(got.lease, scopes=SCOPES, ttl=25)
    assert granted.grant is not None
    return granted.grant


def _same_fields(grant: ExecutionGrant) -> ExecutionGrant:
    """The public constructor, given every field and the MAC of a genuine grant."""
    return ExecutionGrant(grant.grant_id, grant.identity, grant.connector_id, grant.lease_id,
                          grant.epoch, grant.scopes, grant.expires_at, grant.correlation_id,
                          mac=grant._mac)


def _pickled(grant: ExecutionGrant, protocol: int) -> Any:
    return pickle.loads(pickle.dumps(grant, protocol=protocol))


def _ways(gw: Gateway, forge: _Forge, elsewhere: _Forge, second: _Forge, mine: LeaseIdentity,
          pg_dsn: str) -> dict[str, Callable[[], Any]]:
    """Every way to fake or smuggle a grant, each a function making its object."""
    return {
        "copy.copy": lambda: copy.copy(forge.grant()),
        "copy.deepcopy": lambda: copy.deepcopy(forge.grant()),
        **{f"pickle protocol {p}": functools.partial(_pickled_new, forge, p)
           for p in range(pickle.HIGHEST_PROTOCOL + 1)},
        "pickle via copyreg dispatch table": lambda: _copyreg_round_trip(forge.grant()),
        "pickle via reducer_override": lambda: _reducer_override_round_trip(forge.grant()),
        "__new__ + object.__setattr__ (byte-exact replica)": lambda: _rebuilt(
            ExecutionGrant, forge.grant()),
        "constructor with the same fields and MAC": lambda: _same_fields(forge.grant()),
        "attrs.evolve": lambda: attrs.evolve(forge.grant()),
        "subclass instance with the same fields": lambda: _rebuilt(_SubGrant, forge.grant()),
        "SimpleNamespace look-alike": lambda: types.SimpleNamespace(
            **{f.lstrip("_"): getattr(g, f) for f in FIELDS}) if (g := forge.grant()) else None,
        "dict of the fields": lambda: {f: getattr(g, f) for f in FIELDS}
        if (g := forge.grant()) else None,
        "weakref.proxy of a genuine grant": lambda: weakref.proxy(_keep(forge.grant())),
        "object.__setattr__ epoch + 1": lambda: _mutated(g, epoch=g.epoch + 1)
        if (g := forge.grant()) else None,
        "object.__setattr__ scopes widened": lambda: _mutated(
            forge.grant(), scopes=(*SCOPES, "admin:all")),
        "object.__setattr__ expiry + 1 h": lambda: _mutated(
            g, expires_at=g.expires_at + timedelta(hours=1)) if (g := forge.grant()) else None,
        "object.__setattr__ identity (to another lease)": lambda: _mutated(
            second.grant(), identity=mine),
        "object.__setattr__ connector id": lambda: _mutated(forge.grant(),
                                                            connector_id="intruder"),
        "object.__setattr__ lease id": lambda: _mutated(forge.grant(),
                                                        lease_id=second.lease.lease_id),
        "object.__setattr__ correlation id": lambda: _mutated(forge.grant(),
                                                              correlation_id="forged"),
        "MAC transplanted from another genuine grant": lambda: _mutated(
            forge.grant(), _mac=forge.grant()._mac),
        "grant from another coordinator instance": elsewhere.grant,
        "grant from an asyncio coordinator on the same store": lambda: _async_grant(
            pg_dsn, run_prefix("s10a")),
        "grant from a gateway on another store (memory)": _memory_grant,
        "hand-built ConnectorExecutionContext": lambda: ConnectorExecutionContext(
            mine, "gw", forge.lease.lease_id, forge.lease.epoch, SCOPES,
            forge.lease.expires_at, "ctx"),
        "lease handle presented as a grant": lambda: forge.lease,
        "grant minted in a forked child, bytes sent back": lambda: replica(_fork_mint(gw)),
    }


def _pickled_new(forge: _Forge, protocol: int) -> Any:
    return _pickled(forge.grant(), protocol)
