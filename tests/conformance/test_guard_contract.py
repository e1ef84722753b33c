"""The resource-guard contract (:func:`mos_lease.testing.run_guard_contract`) against every
shipped guard, sync and asyncio, and the example SQLite guard; proof that it catches a guard
with a planted flaw; and the shipped guards built only from ``mos_lease.fencing``'s public
helpers."""

from __future__ import annotations

import ast
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

import mos_lease.fencing
from examples.store_kit import SqliteResourceGuard
from mos_lease.fencing import (
    FenceReason,
    GuardDecision,
    ResourceEpoch,
    admit,
    check_resource_id,
    check_token,
)
from mos_lease.testing import EventLoopThread, run_guard_contract
from mos_lease.token import FencingToken
from mos_lease_memory.fencing import AsyncInMemoryResourceGuard, InMemoryResourceGuard
from mos_lease_pg.fencing import AsyncPostgresResourceGuard, PostgresResourceGuard

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def loop() -> Iterator[EventLoopThread]:
    with EventLoopThread() as running:
        yield running


def test_in_memory_guard() -> None:
    run_guard_contract(lambda *, ignore_expiry: InMemoryResourceGuard(
        ignore_expiry=ignore_expiry), durable=False)


def test_async_in_memory_guard(loop: EventLoopThread) -> None:
    run_guard_contract(loop.guard_factory(lambda *, ignore_expiry: AsyncInMemoryResourceGuard(
        InMemoryResourceGuard(ignore_expiry=ignore_expiry))), durable=False)


@pytest.mark.pg
def test_postgres_guard(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        run_guard_contract(lambda *, ignore_expiry: PostgresResourceGuard(
            conn, ignore_expiry=ignore_expiry))


@pytest.mark.pg
def test_async_postgres_guard(pg_dsn: str, loop: EventLoopThread) -> None:
    conn = loop.run(psycopg.AsyncConnection.connect(pg_dsn, autocommit=True))
    try:
        run_guard_contract(loop.guard_factory(lambda *, ignore_expiry: AsyncPostgresResourceGuard(
            conn, ignore_expiry=ignore_expiry)))
    finally:
        loop.run(conn.close())


def test_example_sqlite_guard(tmp_path: Path) -> None:
    made: list[SqliteResourceGuard] = []

    def make(*, ignore_expiry: bool) -> SqliteResourceGuard:
        made.append(SqliteResourceGuard(str(tmp_path / "epochs.db"),
                                        ignore_expiry=ignore_expiry))
        return made[-1]

    try:
        run_guard_contract(make)
    finally:
        for guard in made:
            guard.close()


# -- the contract catches a broken guard ---------------------------------------------------


class FlawedGuard:
    """The in-memory guard's logic with one planted flaw."""

    def __init__(self, flaw: str, *, ignore_expiry: bool) -> None:
        self.flaw, self.ignore_expiry = flaw, ignore_expiry
        self._lock = threading.Lock()
        self._resources: dict[str, ResourceEpoch] = {}

    def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        if self.flaw != "no_input_check":
            resource_id, token = check_resource_id(resource_id), check_token(token)
        ignore = self.ignore_expiry or self.flaw == "ignores_expiry"
        with self._lock:
            current = self._resources.get(resource_id)
            after, decision = admit(current, token, resource_id, now=datetime.now(UTC),
                                    expiry_grace=None if ignore else mos_lease.fencing.NO_GRACE)
            if self.flaw == "admits_lower" and decision.reason is FenceReason.STALE_EPOCH:
                after = ResourceEpoch(token.identity, token.epoch)
                decision = GuardDecision(resource_id, None, token.epoch)
            if self.flaw == "records_refusals" and not decision.ok:
                after = ResourceEpoch(token.identity, token.epoch)
            if after is not None:
                self._resources[resource_id] = after
            return decision


FLAWS = ("admits_lower", "records_refusals", "ignores_expiry", "no_input_check")


@pytest.mark.parametrize("flaw", [*FLAWS, None])
def test_contract_catches_a_flawed_guard(flaw: str | None) -> None:
    def make(*, ignore_expiry: bool) -> FlawedGuard:
        return FlawedGuard(flaw or "", ignore_expiry=ignore_expiry)

    if flaw is None:  # the same guard without a flaw passes: only the flaw is caught
        run_guard_contract(make, durable=False)
        return
    with pytest.raises(AssertionError):
        run_guard_contract(make, durable=False)


# -- one implementation: the shipped guards use the public helpers --------------------------


@pytest.mark.parametrize("path", ["mos_lease_memory/fencing.py", "mos_lease_pg/fencing.py",
                                  "examples/store_kit.py"])
def test_guards_use_only_public_helpers(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    used: set[str] = {alias.name for node in ast.walk(tree)
                      if isinstance(node, ast.ImportFrom) and node.module == "mos_lease.fencing"
                      for alias in node.names}
    assert used >= {"admit", "check_resource_id", "check_token", "judged_grace"}
    assert used <= set(mos_lease.fencing.__all__), used - set(mos_lease.fencing.__all__)
    for name in used:
        assert getattr(mos_lease.fencing, name).__doc__, f"{name} has no docstring"


def test_public_guard_types_are_exported() -> None:
    """What a gateway guarding a resource needs is at the top level; the types a guard's
    author works with are public in ``mos_lease.fencing``."""
    import mos_lease

    for name in ("ResourceGuard", "FencedEffectRefused"):
        assert name in mos_lease.__all__ and getattr(mos_lease, name) is getattr(
            mos_lease.fencing, name)
    for name in ("ResourceEpoch", "GuardDecision", "FenceReason", "ResourceGuard",
                 "AsyncResourceGuard", "FencedEffectRefused"):
        assert name in mos_lease.fencing.__all__


