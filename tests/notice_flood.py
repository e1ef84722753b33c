"""A flood of forged lease notices, as any login may send one: a role with ``LOGIN`` and no
privilege at all, and one statement that sends many distinct well-formed notices for one
identity (PostgreSQL folds identical notices of a transaction into one, so the epochs
differ), plus a count of the reads a store is asked for."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

from mos_lease import LeaseIdentity
from mos_lease_pg import LeaseNotices
from tests.pg_support import unique_name, with_params

FLOOD_SQL = (
    "SELECT count(pg_notify(%(channel)s, json_build_object("
    "'t', i.t, 'a', i.a, 'b', i.b, 'e', %(epoch)s::bigint + g, 'k', 'takeover')::text))"
    " FROM unnest(%(t)s::text[], %(a)s::text[], %(b)s::text[]) AS i(t, a, b),"
    " generate_series(1, %(count)s) AS g")


@contextmanager
def unprivileged_login(admin: psycopg.Connection[Any], dsn: str) -> Iterator[str]:
    """A DSN for a new role that may log in and nothing else (no grant of any kind: what
    every role may do, ``NOTIFY`` included, is all it has); dropped after."""
    role = unique_name("notice_forger")
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
                  .format(sql.Identifier(role)))
    try:
        yield with_params(dsn, user=role)
    finally:
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def send_flood(dsn: str, channel: str, identities: Sequence[LeaseIdentity], count: int,
               above_epoch: int, conn: psycopg.Connection[Any] | None = None) -> float:
    """Send ``count`` distinct notices for each of ``identities``, claiming takeovers at
    epochs above ``above_epoch``, in one statement, as the role of ``dsn`` (or on ``conn``,
    a connection of that role); the seconds it took."""
    with contextlib.ExitStack() as stack:
        if conn is None:
            conn = stack.enter_context(psycopg.connect(dsn, autocommit=True))
        began = time.monotonic()
        row = conn.execute(FLOOD_SQL, {
            "channel": channel, "t": [i.tenant_id for i in identities],
            "a": [i.logical_agent_id for i in identities],
            "b": [i.binding_id for i in identities], "epoch": above_epoch,
            "count": count}).fetchone()
        took = time.monotonic() - began
    assert row is not None and row[0] == count * len(identities)
    return took


def count_loads(store: Any) -> list[int]:
    """Count the rows read by ``store.load`` and ``store.load_many`` (sync or async) from now
    on: a one-item list."""
    calls = [0]
    for name, rows in (("load", lambda _args: 1), ("load_many", len)):
        _count_rows(store, name, rows, calls)
    return calls


def _count_rows(store: Any, name: str, rows: Callable[[Any], int], calls: list[int]) -> None:
    real = getattr(store, name)
    if inspect.iscoroutinefunction(real):
        async def counting_async(arg: Any) -> Any:
            calls[0] += rows(arg)
            return await real(arg)
        setattr(store, name, counting_async)
    else:
        def counting(arg: Any) -> Any:
            calls[0] += rows(arg)
            return real(arg)
        setattr(store, name, counting)


def turn_bound(rate: float, burst: int, seconds: float) -> float:
    """The most confirming turns a confirmer's bound lets start in ``seconds``: its bucket
    full at the start, and its refill."""
    return burst + rate * seconds


class Heard:
    """Counts the notices a listener hands out for some identities, as any subscriber sees
    them (only the listener's thread counts)."""

    def __init__(self, source: LeaseNotices, *identities: LeaseIdentity) -> None:
        self.count = 0
        for identity in identities:
            source.subscribe(identity, self)

    def __call__(self, _epoch: int, _kind: str) -> None:
        self.count += 1

    def wait_for(self, count: int, timeout: float) -> float:
        """Wait until ``count`` have been handed out, or ``timeout`` passed; when."""
        deadline = time.monotonic() + timeout
        while self.count < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return time.monotonic()

    def all(self, count: int, timeout: float = 30.0) -> float:
        """Wait until ``count`` have been handed out (which must happen within
        ``timeout``); when."""
        when = self.wait_for(count, timeout)
        assert self.count >= count, f"heard {self.count} of {count}"
        return when
