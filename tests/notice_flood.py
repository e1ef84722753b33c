"""A flood of forged lease notices, as any login may send one: a role with ``LOGIN`` and no
privilege at all, and one statement that sends many distinct well-formed notices for one
identity (PostgreSQL folds identical notices of a transaction into one, so the epochs
differ), plus a count of the reads a store is asked for."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

from mos_lease import LeaseIdentity
from tests.pg_support import unique_name, with_params

FLOOD_SQL = (
    "SELECT count(pg_notify(%(channel)s, json_build_object("
    "'t', %(t)s::text, 'a', %(a)s::text, 'b', %(b)s::text,"
    " 'e', %(epoch)s::bigint + g, 'k', 'takeover')::text))"
    " FROM generate_series(1, %(count)s) AS g")


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


def send_flood(dsn: str, channel: str, identity: LeaseIdentity, count: int,
               above_epoch: int) -> float:
    """Send ``count`` distinct notices claiming takeovers of ``identity`` at epochs above
    ``above_epoch``, in one statement, as the role of ``dsn``; the seconds it took."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        began = time.monotonic()
        row = conn.execute(FLOOD_SQL, {"channel": channel, "t": identity.tenant_id,
                                       "a": identity.logical_agent_id,
                                       "b": identity.binding_id, "epoch": above_epoch,
                                       "count": count}).fetchone()
        took = time.monotonic() - began
    assert row is not None and row[0] == count
    return took


def count_loads(store: Any) -> list[int]:
    """Count the calls of ``store.load`` (sync or async) from now on: a one-item list."""
    calls = [0]
    real = store.load
    if inspect.iscoroutinefunction(real):
        async def counting_async(identity: LeaseIdentity) -> Any:
            calls[0] += 1
            return await real(identity)
        store.load = counting_async
    else:
        def counting(identity: LeaseIdentity) -> Any:
            calls[0] += 1
            return real(identity)
        store.load = counting
    return calls


def turn_bound(rate: float, burst: int, seconds: float) -> float:
    """The most confirming turns a confirmer's bound lets start in ``seconds``: its bucket
    full at the start, and its refill."""
    return burst + rate * seconds
