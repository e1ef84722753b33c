"""Scenario 12: bad input on every public entry point -> typed errors only, 0 rows written.

A seeded generator builds calls to every public entry point (the coordinator's nine
methods, its constructor options, ``LeaseIdentity``, the policy document parser and the
store's operator views) in which arguments are replaced by bad values: malformed ids (empty,
padded, control and format characters, lone surrogates from non-UTF-8 text, over-long),
SQL and LIKE metacharacters, bad scopes, TTLs (zero, negative, NaN, infinite, above the
caps, wrong types), epochs out of range, wrong types everywhere. Some generated values are
valid but nasty (SQL text, emoji, 128-character ids): those must go through and round-trip.

Every call must end in a typed result or a typed error (``InvalidInput``,
``ConfigurationError``); a call refused as bad input must have written nothing (the store's
footprint is compared before and after). Any other exception is a crash. The cases run on
the in-memory store (10,000 in every run) and on PostgreSQL (10,000 under ``--soak``).
"""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any
from uuid import uuid4

import attrs
import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    GrantResult,
    InvalidInput,
    InvocationResult,
    LeaseHandle,
    LeaseIdentity,
    LeaseResult,
    MosLeaseError,
    StaticConnectorPolicy,
    ValidationResult,
)
from mos_lease_memory import InMemoryLeaseStore
from mos_lease_pg import PostgresLeaseStore
from tests.faults.support import ROOT, Table, footprint, run_prefix, scaled

pytestmark = [pytest.mark.faults, pytest.mark.pg]

SQL = ["x'; DROP TABLE logical_agent_connector_leases; --", "a\\'b", "%", "_", "a%b_c",
       "$1", "NULL", "); DELETE FROM connector_lease_audit_log; --", '"; --', "E'\\x00'"]
GOOD_IDS = ["a", "agent-7", "ÄÖÜ", "\U0001f642", "x" * 128, "a b", "日本", *SQL]
BAD_IDS: list[Any] = [  # (None is bad for ids; for correlation ids it means "make one")
    "", " a", "a ", "\t", "\n", "a\nb", "\x00", "a\x00b", "\x7f", "\x85", "\x1b[31m",
    "\u200b", "a\u202eb", "\u2066", "\ufeff", "\ud800", "caf\udce9",
    b"\xff\xfe".decode("utf-8", "surrogateescape"), "x" * 129, "y" * 10_000,
    b"agent", bytearray(b"a"), memoryview(b"a"), 1, 0, -1, 1.5, None, True, [], ["a"], {},
    ("a",), object(), uuid4(), Decimal(1),
]
BAD_CORRELATION = [v for v in BAD_IDS if v is not None]
GOOD_SCOPES: list[Any] = [[], ["tool:read"], ("tool:read", "tool:read"), {"tool:run"},
                          ["tool:read", "tool:run"], {"tool:read": 1}]
BAD_SCOPES: list[Any] = [
    "tool:read", b"tool:read", ["Tool:Read"], ["tool:*"], ["*"], [""], [" tool"],
    ["tool: read"], ["tool:read\x00"], ["t" * 129], [1], [None], [b"tool"],
    [f"s{i}" for i in range(65)], ["tool:read'; DROP TABLE x; --"], ["tool::read"],
    [":tool"], ["tool:"], ["tool:read\n"], ["\udcff"], ["\uff54ool"], 5, None, object(), 1.5,
    [["tool:read"]], ["tool:read"] * 300,
]


class ManyScopes:
    """An iterable of 20,000 copies of one valid scope, fresh on every iteration (a shared
    iterator would be used up by earlier cases and turn into a valid empty one)."""

    def __iter__(self) -> Iterator[str]:
        return itertools.repeat("tool:read", 20_000)


BAD_SCOPES.append(ManyScopes())
GOOD_TTLS: list[Any] = [1, 0.5, timedelta(seconds=10), timedelta(microseconds=1), 29, 30]
BAD_TTLS: list[Any] = [
    0, -1, 0.0, -0.0, 1e-7, math.nan, math.inf, -math.inf, 301, 10**300, -(10**300),
    10**400, -(10**400), True,
    False, None, "10", b"10", Decimal(1), timedelta(0), timedelta(seconds=-1),
    timedelta(days=1), timedelta.max, [], object(), 1j,
]
# Ints beyond the float range crashed normalize_ttl with OverflowError until 9c81759 (found
# by this scenario); pinned by test_ttl_beyond_float_range_is_refused below.
HUGE_TTLS: list[Any] = [10**400, -(10**400)]
BAD_EPOCHS: list[Any] = [0, -1, 2**63, 2**64, -(2**63), True, False, 1.0, "1", None,
                         Decimal(1), [1], math.nan]
BAD_UUIDS: list[Any] = ["9b2c6f0e-1c1a-4c4e-8f8a-1b2c3d4e5f60", 1, None, b"\x00" * 16, [],
                        object()]


@dataclass
class Target:
    """The store and coordinator under attack, and how to see whether anything changed."""

    name: str
    coordinator: ConnectorLeaseCoordinator
    footprint: Callable[[], Any]
    prefix: str
    serial: int = 0

    def fresh(self) -> LeaseIdentity:
        self.serial += 1
        return LeaseIdentity(self.prefix, "agent", f"b{self.serial}")

    def lease(self) -> LeaseHandle:
        got = self.coordinator.acquire(self.fresh(), "conn", scopes=["tool:read", "tool:run"],
                                       ttl=60)
        assert got.lease is not None
        return got.lease


def _pick(rng: random.Random, good: list[Any], bad: list[Any], bad_p: float) -> tuple[Any, bool]:
    if rng.random() < bad_p:
        return rng.choice(bad), True
    return rng.choice(good), False


def _bad_handle(rng: random.Random, lease: LeaseHandle) -> tuple[Any, bool]:
    """A lease handle with one field wrong, or something that is not a handle at all; and
    whether that is bad input (``expires_at`` is informational: handles are plain data
    matched on identity, connector, lease id and epoch, so garbage there is ignored)."""
    choice = rng.randrange(7)
    if choice == 0:
        return rng.choice([None, {}, "lease", 7, lease.identity, (lease,), object()]), True
    if choice == 1:
        return attrs.evolve(lease, connector_id=rng.choice(BAD_IDS)), True
    if choice == 2:
        return attrs.evolve(lease, lease_id=rng.choice(BAD_UUIDS)), True
    if choice == 3:
        return attrs.evolve(lease, epoch=rng.choice(BAD_EPOCHS)), True
    if choice == 4:
        return attrs.evolve(lease, identity=_any(rng.choice([None, ("a", "b", "c"),
                                                             "a/b/c"]))), True
    if choice == 5:
        return attrs.evolve(lease, scopes=rng.choice(BAD_SCOPES)), True
    return attrs.evolve(lease, expires_at=_any(rng.choice([None, "tomorrow", 0]))), False


Case = tuple[str, Callable[[], Any], bool]
P = 0.5  # each argument is drawn bad with this probability


def _any(value: object) -> Any:
    """Bad values are bad on purpose: the type checker is told not to mind."""
    return value


def _identity_case(rng: random.Random, t: Target) -> Case:
    parts = [_pick(rng, GOOD_IDS, BAD_IDS, P) for _ in range(3)]
    return "identity", lambda: LeaseIdentity(*(v for v, _ in parts)), any(b for _, b in parts)


def _acquire_case(rng: random.Random, t: Target, entry: str) -> Case:
    c = t.coordinator
    identity, bad_i = _pick(rng, [t.fresh()], [None, "a/b/c", ("a", "b", "c"), 3], P / 2)
    connector, bad_c = _pick(rng, ["conn"], BAD_IDS, P)
    scopes, bad_s = _pick(rng, GOOD_SCOPES, BAD_SCOPES, P)
    ttl, bad_t = _pick(rng, GOOD_TTLS, BAD_TTLS, P)
    corr, bad_r = _pick(rng, [None, "corr-1", *SQL], BAD_CORRELATION, P / 2)
    epoch, bad_e = _pick(rng, [1, 2], BAD_EPOCHS, P)
    bad = bad_i or bad_c or bad_s or bad_t or bad_r or (entry == "takeover" and bad_e)
    if entry == "acquire":
        return entry, lambda: c.acquire(identity, connector, scopes=scopes, ttl=ttl,
                                        correlation_id=corr), bad
    return entry, lambda: c.takeover(identity, connector, scopes=scopes, ttl=ttl,
                                     expected_epoch=epoch, correlation_id=corr), bad


def _holder_case(rng: random.Random, t: Target, entry: str) -> Case:
    c = t.coordinator
    lease = t.lease()
    handle, bad_h = _bad_handle(rng, lease) if rng.random() < P else (lease, False)
    ttl, bad_t = _pick(rng, GOOD_TTLS, BAD_TTLS, P)
    corr, bad_r = _pick(rng, [None, "corr-2"], BAD_CORRELATION, P / 3)
    scopes, bad_s = _pick(rng, [["tool:read"], []], BAD_SCOPES, P)
    if entry == "heartbeat":
        return entry, lambda: c.heartbeat(handle, ttl=ttl, correlation_id=corr), \
            bad_h or bad_t or bad_r
    if entry == "release":
        return entry, lambda: c.release(handle, correlation_id=corr), bad_h or bad_r
    if entry == "issue_grant":
        return entry, lambda: c.issue_grant(handle, scopes=scopes, ttl=ttl,
                                            correlation_id=corr), bad_h or bad_t or bad_r or bad_s
    leases, bad_l = _pick(rng, [[handle], (handle,)],
                          [handle, "x", None, [handle, None], (h for h in [handle]),
                           [handle] * 1001, {"lease": handle}], P)
    return entry, lambda: c.heartbeat_many(leases, ttl=ttl, correlation_id=corr), \
        bad_l or bad_h or bad_t or bad_r


def _grant_case(rng: random.Random, t: Target, entry: str) -> Case:
    c = t.coordinator
    lease = t.lease()
    granted = c.issue_grant(lease, scopes=["tool:read"], ttl=10)
    assert granted.grant is not None
    # An unrecognized grant is a refusal (grant_unknown), not bad input: not flagged.
    grant, _ = _pick(rng, [granted.grant], [None, {}, "grant", lease, 1], P / 2)
    identity, bad_i = _pick(rng, [lease.identity], [None, ("a", "b", "c"), "t/a/b", lease],
                            P / 2)
    scopes, bad_s = _pick(rng, [["tool:read"], []], BAD_SCOPES, P)
    corr, bad_r = _pick(rng, [None, "corr-3"], BAD_CORRELATION, P / 3)
    if entry == "validate":
        return entry, lambda: c.validate(grant, identity=identity, scopes=scopes,
                                         correlation_id=corr), bad_i or bad_s or bad_r
    adapter, bad_a = _pick(rng, [lambda ctx: "ran"], [None, 1, "adapter"], P / 2)
    return entry, lambda: c.invoke(grant, adapter, identity=identity, scopes=scopes,
                                   correlation_id=corr), bad_i or bad_s or bad_r or bad_a


def _config_case(rng: random.Random, t: Target, entry: str) -> Case:
    c = t.coordinator
    store: Any = c.store
    if entry == "reconcile":
        identity, bad_i = _pick(rng, [t.fresh()], [None, "x", 1], P)
        event, bad_e = _pick(rng, [uuid4()], BAD_UUIDS, P)
        return entry, lambda: c.reconcile(identity, event), bad_i or bad_e
    if entry == "options":
        option = rng.choice(["lease_ttl_cap", "grant_ttl_cap", "max_conflict_retries"])
        value = rng.choice({"lease_ttl_cap": [*BAD_TTLS, 301, 1000],
                            "grant_ttl_cap": [*BAD_TTLS, 31, 301],
                            "max_conflict_retries": [-1, 101, True, 1.5, None, "3",
                                                     10**20]}[option])
        return entry, lambda: ConnectorLeaseCoordinator(store, AllowAllPolicy(),
                                                        **{option: value}), True
    if entry == "policy":
        rule: dict[Any, Any] = {"tenant_id": "*", "logical_agent_id": "*", "binding_id": "*",
                                "connector_id": "c", "scopes": ["tool:read"],
                                "max_lease_ttl": 60, "max_grant_ttl": 10}
        key = rng.choice([*rule, "preempt_active", "unknown", 1, None])
        rule[key] = rng.choice([*BAD_IDS[:20], *BAD_TTLS[:10], "t*", "*a", ["X"], {"a": 1}])
        doc = _any(rng.choice([{"rules": [rule]}, {"rules": rule}, {"rules": [rule], "x": 1},
                               [rule], "rules", None, {"rules": "abc"}]))
        return entry, lambda: StaticConnectorPolicy.from_dict(doc), True
    if rng.random() < 0.5:
        tenant = rng.choice([v for v in BAD_IDS if v is not None])  # None: every tenant
        return entry, lambda: store.leases(tenant), True
    after = rng.choice([-1, "1", None, 2**63, 1.5, 0])
    limit = rng.choice([0, -1, 10**9, True, "5", None])
    return entry, lambda: store.audit(None, after_seq=after, limit=limit), True


def _case(rng: random.Random, t: Target) -> Case:
    """One generated call: (entry point, thunk, whether any argument was drawn bad)."""
    entry = rng.choice(["identity", "acquire", "takeover", "heartbeat", "heartbeat_many",
                        "release", "issue_grant", "validate", "invoke", "reconcile",
                        "options", "policy", "views"])
    if entry == "identity":
        return _identity_case(rng, t)
    if entry in ("acquire", "takeover"):
        return _acquire_case(rng, t, entry)
    if entry in ("heartbeat", "release", "issue_grant", "heartbeat_many"):
        return _holder_case(rng, t, entry)
    if entry in ("validate", "invoke"):
        return _grant_case(rng, t, entry)
    return _config_case(rng, t, entry)


_TYPED_RESULTS = (LeaseResult, GrantResult, ValidationResult, InvocationResult, bool,
                  ConnectorLeaseCoordinator, StaticConnectorPolicy, LeaseIdentity, list,
                  tuple)


def _run(target: Target, cases: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    crashes: list[str] = []
    wrote: list[str] = []
    outcomes: Counter[str] = Counter()
    by_entry: Counter[str] = Counter()
    good_rejected: list[str] = []
    bad_accepted: list[str] = []
    for i in range(cases):
        entry, call, bad = _case(rng, target)
        by_entry[entry] += 1
        before = target.footprint()
        try:
            result = call()
        except (InvalidInput, ConfigurationError) as exc:
            outcomes[type(exc).__name__] += 1
            if target.footprint() != before:
                wrote.append(f"case {i} {entry}: {exc}")
            if not bad:
                good_rejected.append(f"case {i} {entry}: {exc}")
            continue
        except MosLeaseError as exc:
            outcomes[type(exc).__name__] += 1
            crashes.append(f"case {i} {entry}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        except Exception as exc:  # anything untyped is a crash
            crashes.append(f"case {i} {entry}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        if not isinstance(result, _TYPED_RESULTS):
            crashes.append(f"case {i} {entry}: untyped result {type(result).__name__}")
        if bad:
            bad_accepted.append(f"case {i} {entry}: {str(result)[:100]}")
        outcomes["typed result"] += 1
    return {"crashes": crashes, "wrote": wrote, "outcomes": outcomes, "entries": by_entry,
            "good_rejected": good_rejected, "bad_accepted": bad_accepted}


def test_bad_input_fuzzing(pg_dsn: str, admin: psycopg.Connection[Any], soak: bool,
                           figures: Table) -> None:
    memory_cases = 10_000
    pg_cases = scaled(soak, 2_000, 10_000)
    memory_store = InMemoryLeaseStore()
    memory = Target("memory", ConnectorLeaseCoordinator(memory_store, AllowAllPolicy()),
                    # Its internals, read directly: every audit row and every lease row.
                    lambda: (len(memory_store._audit), dict(memory_store._rows)),
                    run_prefix("s12m"))
    pg_store = PostgresLeaseStore(pg_dsn)
    try:
        pg = Target("PostgreSQL", ConnectorLeaseCoordinator(pg_store, AllowAllPolicy()),
                    lambda: footprint(admin), run_prefix("s12p"))
        results = {"memory": _run(memory, memory_cases, seed=12),
                   "PostgreSQL": _run(pg, pg_cases, seed=1212)}
        # The valid-but-nasty ids went all the way through and came back byte for byte.
        nasty = [LeaseIdentity(pg.prefix, sql, "\U0001f642" + sql[:100]) for sql in SQL]
        for identity in nasty:
            pg.coordinator.acquire(identity, sql_conn := "c'--", scopes=[], ttl=30)
        stored = {(r.identity.logical_agent_id, r.identity.binding_id, r.connector_id)
                  for r in pg_store.leases(pg.prefix)}
        round_trip = all((i.logical_agent_id, i.binding_id, sql_conn) in stored for i in nasty)
        tables = admin.execute("SELECT count(*) FROM pg_tables WHERE tablename IN "
                               "('logical_agent_connector_leases', "
                               "'connector_lease_audit_log')").fetchone()
    finally:
        pg_store.close()

    total = memory_cases + pg_cases
    figures.add("spec. figure / this run", f">= 10,000 cases / {memory_cases} on memory + "
                f"{pg_cases} on PostgreSQL")
    figures.counts("generated cases", 10_000, total)
    for name, res in results.items():
        figures.add(f"{name}: outcomes", dict(res["outcomes"].most_common()))
        figures.add(f"{name}: crashes (untyped or unexpected errors)", len(res["crashes"]),
                    "0", not res["crashes"])
        figures.add(f"{name}: rows written for rejected input", len(res["wrote"]), "0",
                    not res["wrote"])
        figures.add(f"{name}: valid input rejected", len(res["good_rejected"]), "0",
                    not res["good_rejected"])
        figures.add(f"{name}: bad input let through", len(res["bad_accepted"]), "0",
                    not res["bad_accepted"])
        figures.notes += res["good_rejected"][:5] + res["bad_accepted"][:5]
        figures.notes += sorted({c.split(": ", 1)[1] for c in res["crashes"]})[:8]
        figures.notes += res["wrote"][:8]
    figures.add("entry points covered", len(results["memory"]["entries"]), ">= 13",
                len(results["memory"]["entries"]) >= 13)
    figures.add("SQL-metacharacter ids stored and read back byte for byte", round_trip,
                "True", round_trip)
    table_count = tables[0] if tables is not None else 0
    figures.add("tables still there", table_count, "2", table_count == 2)
    assert not figures.failed(), figures.render()


def test_endless_scopes_iterable_is_refused() -> None:
    """``scopes=itertools.repeat("tool:read")`` must be refused, not loop forever (run in a
    child process that is killed after 10 s). It looped forever until 9c81759, which
    bounded the items read (found by this scenario)."""
    code = ("import itertools\n"
            "from mos_lease import ConnectorLeaseCoordinator, AllowAllPolicy, LeaseIdentity\n"
            "from mos_lease_memory import InMemoryLeaseStore\n"
            "c = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())\n"
            "try:\n"
            "    c.acquire(LeaseIdentity('t', 'a', 'b'), 'c', "
            "scopes=itertools.repeat('tool:read'), ttl=5)\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=10, check=False)
    assert "InvalidInput" in done.stdout


@pytest.mark.parametrize("ttl", HUGE_TTLS, ids=["10**400", "-(10**400)"])
def test_ttl_beyond_float_range_is_refused(ttl: int) -> None:
    """Refused as bad input everywhere a TTL is taken (an OverflowError until 9c81759)."""
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    with pytest.raises(InvalidInput):
        coordinator.acquire(LeaseIdentity("t", "a", "b"), "c", scopes=[], ttl=ttl)
    with pytest.raises(ConfigurationError):
        ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy(),
                                  lease_ttl_cap=ttl)
    with pytest.raises(ConfigurationError):
        StaticConnectorPolicy.from_dict({"rules": [{
            "tenant_id": "*", "logical_agent_id": "*", "binding_id": "*", "connector_id": "c",
            "scopes": [], "max_lease_ttl": ttl, "max_grant_ttl": 10}]})


def _unvalidated(tenant: str) -> LeaseIdentity:
    obj = object.__new__(LeaseIdentity)
    for name, value in (("tenant_id", tenant), ("logical_agent_id", "agent"),
                        ("binding_id", "b")):
        object.__setattr__(obj, name, value)
    return obj


def test_identity_built_around_its_validators_is_refused(
        pg_dsn: str, admin: psycopg.Connection[Any]) -> None:
    store = PostgresLeaseStore(pg_dsn)
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    problems = []
    try:
        for tenant in ("", "t\x00", "x" * 200, " padded ", "a\u202eb"):
            before = footprint(admin)
            try:
                coordinator.acquire(_unvalidated(tenant), "c", scopes=[], ttl=5)
                problems.append(f"{tenant[:12]!r}: accepted")
            except InvalidInput:
                pass
            except MosLeaseError as exc:
                problems.append(f"{tenant[:12]!r}: {type(exc).__name__}")
            if footprint(admin) != before:
                problems.append(f"{tenant[:12]!r}: wrote rows")
    finally:
        store.close()
    assert not problems, problems
