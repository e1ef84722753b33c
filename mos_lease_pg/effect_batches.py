"""Fenced effects that overlap in time share one transaction and one commit.

A gateway that writes one fenced effect per request opens a transaction per request
(:func:`~mos_lease_pg.effects.fenced_transaction_async`: ``BEGIN``, the lease row locked and
checked, the effect, ``COMMIT``), and under load each of those round trips waits for the
event loop: the effect connections, held for all four, bound the request rate. Here the
effects that asyncio tasks submit while the effect connections are busy queue, and go out
together::

    effects = CoalescedEffects(pool)                       # one per process and pool
    row = await effects.execute(context, "INSERT INTO app.outbox ... RETURNING id",
                                params, scopes=["outbox:write"])

A batch is one transaction on one connection of ``pool``: every effect's current lease row
locked ``FOR SHARE`` in one statement (``lock_current_leases.sql``), the clock read once the
locks are held, each effect judged on its own row exactly as a fenced transaction judges it
(:func:`~mos_lease_pg.effects.judge_locked_row`, the same function), the statements of those
that pass sent in one pipeline, then one ``COMMIT``. So each effect still commits only while
its lease's epoch is current, checked in the transaction that writes it, and no effect of an
old epoch can follow a takeover (the takeover waits for the share locks, or the lock sees it).

What each caller is told:

* **Refused alone.** An effect whose fence fails is refused with
  :class:`~mos_lease.fencing.FencedEffectRefused` (its own reason); its statement is not sent,
  and the others go on.
* **Its own statement's error alone.** If a statement fails (a constraint of the effect's
  table, say), the whole transaction rolls back, nothing of it is written, and every effect
  that passed goes again on its own in a fenced transaction of its own: only the failing
  one's caller gets the error.
* **Its first row.** The statement's first row (``RETURNING ...``), or ``None`` for a
  statement that returns no rows.
* **The commit's failure** (the connection lost at ``COMMIT``) is every caller's of that
  batch, as a fenced transaction's own would be: whether it committed is unknown.
* **Cancellation** of a queued caller withdraws its effect; once its batch went out, the
  batch is not cancelled with it.

Keep the statements short and independent of each other: they share a transaction, and the
lease rows of a batch stay share-locked (their renewals wait, or skip them and retry) until
its commit. Without overlap an effect costs one transaction, as a fenced transaction does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any, Final

import psycopg
import psycopg_pool
from psycopg import sql
from psycopg.abc import Params
from psycopg.rows import tuple_row

from mos_lease.errors import InvalidInput
from mos_lease.fencing import FenceCheck, ValidUntil, fence_check
from mos_lease.identity import LeaseIdentity
from mos_lease_pg.effects import (
    MISCONFIGURED_EFFECT_ERRORS,
    Fence,
    fenced_transaction_async,
    judge_locked_row,
    misconfigured,
)
from mos_lease_pg.sql_files import DEFAULT_SCHEMA, Template, statement_text

Statement = str | bytes | sql.SQL | sql.Composed
"""An effect's statement, as a psycopg cursor's ``execute`` takes it."""

LOCK_CURRENT_LEASES: Final = Template("lock current leases",
                                      statement_text("lock_current_leases.sql"))
MAX_EFFECTS: Final = 200  # the most effects one transaction carries; more wait for the next


class _Effect:
    __slots__ = ("check", "fence", "future", "params", "statement")

    def __init__(self, fence: Fence, check: FenceCheck, statement: Statement,
                 params: Params | None, future: asyncio.Future[tuple[Any, ...] | None]) -> None:
        self.fence = fence
        self.check = check
        self.statement = statement
        self.params = params
        self.future = future


class _Redo(Exception):
    """A statement of the batch failed: rolled back, each effect goes again alone."""


class CoalescedEffects:
    """Fenced effects of one process's asyncio tasks, coalesced per transaction (see the
    module). ``pool`` gives the connections (at most ``batches`` transactions at once: by
    default the pool's ``max_size``); ``schema`` is where the lease table is, as
    ``ConnectionSettings.schema``."""

    __slots__ = ("_batches", "_in_flight", "_pool", "_scheduled", "_schema", "_waiting")

    def __init__(self, pool: psycopg_pool.AsyncConnectionPool[Any], *,
                 schema: str = DEFAULT_SCHEMA, batches: int | None = None) -> None:
        if batches is not None and (type(batches) is not int or batches < 1):
            raise InvalidInput("batches", "must be a positive int")
        self._pool = pool
        self._schema = schema
        self._batches = pool.max_size if batches is None else batches
        self._waiting: list[_Effect] = []
        self._in_flight = 0
        self._scheduled = False

    async def execute(self, fence: Fence, statement: Statement, params: Params | None = None, *,
                      scopes: Iterable[str], identity: LeaseIdentity | None = None,
                      valid_until: ValidUntil = ValidUntil.CONTEXT) -> tuple[Any, ...] | None:
        """Run ``statement`` with ``params`` as a fenced effect of ``fence`` (arguments as
        :func:`~mos_lease_pg.effects.fenced_transaction_async`'s), in a transaction shared
        with the effects that overlap it; its first row, or ``None``. Raises
        :class:`~mos_lease.fencing.FencedEffectRefused` if the fence fails, and the
        statement's own error if it fails."""
        check = fence_check(fence, scopes, identity, valid_until)  # bad input: raised here
        loop = asyncio.get_running_loop()
        effect = _Effect(fence, check, statement, params, loop.create_future())
        self._waiting.append(effect)
        self._schedule()
        try:
            return await effect.future
        except asyncio.CancelledError:
            if effect in self._waiting:  # not sent yet: left out
                self._waiting.remove(effect)
            raise

    def _schedule(self) -> None:
        # One turn of the loop first: the effects submitted in the same turn join the batch.
        if self._waiting and self._in_flight < self._batches and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._start)

    def _start(self) -> None:
        self._scheduled = False
        if not self._waiting or self._in_flight >= self._batches:
            return
        batch = self._waiting[:MAX_EFFECTS]
        del self._waiting[:MAX_EFFECTS]
        self._in_flight += 1
        asyncio.get_running_loop().create_task(self._send(batch))

    async def _send(self, batch: list[_Effect]) -> None:
        try:
            async with self._pool.connection() as conn:
                try:
                    await self._together(conn, batch)
                except _Redo:
                    for effect in batch:
                        if not effect.future.done():
                            await self._alone(conn, effect)
        except BaseException as error:
            for effect in batch:
                if not effect.future.done():
                    effect.future.set_exception(error)
            if not isinstance(error, Exception):
                raise
        finally:
            self._in_flight -= 1
            self._schedule()

    async def _together(self, conn: psycopg.AsyncConnection[Any],
                        batch: Sequence[_Effect]) -> None:
        passed: list[_Effect] = []
        answers: list[tuple[Any, ...] | None] = []
        async with conn.transaction():
            ids = [e.check.token.identity for e in batch]
            try:
                async with conn.cursor(row_factory=tuple_row) as lock:
                    await lock.execute(LOCK_CURRENT_LEASES.at(self._schema).text, {
                        "tenant_ids": [i.tenant_id for i in ids],
                        "logical_agent_ids": [i.logical_agent_id for i in ids],
                        "binding_ids": [i.binding_id for i in ids]})
                    rows = await lock.fetchall()
            except MISCONFIGURED_EFFECT_ERRORS as exc:
                raise misconfigured(exc, in_effect=False, schema=self._schema,
                                    user=conn.info.user) from exc
            refused = []
            for effect, row in zip(batch, rows, strict=True):
                _, reason = judge_locked_row(effect.check, row)
                if reason is None:
                    passed.append(effect)
                else:
                    refused.append((effect, effect.check.refused(reason)))
            for effect, error in refused:  # nothing of theirs is sent
                if not effect.future.done():
                    effect.future.set_exception(error)
            if passed:
                try:
                    cursors = []
                    async with conn.pipeline():
                        for effect in passed:
                            cur = conn.cursor(row_factory=tuple_row)
                            await cur.execute(effect.statement, effect.params)
                            cursors.append(cur)
                    for cur in cursors:
                        answers.append(await cur.fetchone() if cur.description else None)
                except psycopg.OperationalError:
                    raise  # the connection's failure, not a statement's: every caller's
                except psycopg.Error as exc:
                    raise _Redo() from exc  # rolls the transaction back
        for effect, answer in zip(passed, answers, strict=True):  # committed
            if not effect.future.done():
                effect.future.set_result(answer)

    async def _alone(self, conn: psycopg.AsyncConnection[Any], effect: _Effect) -> None:
        check = effect.check
        try:
            async with fenced_transaction_async(
                    conn, effect.fence, scopes=check.needed, schema=self._schema,
                    valid_until=check.valid_until) as cur:
                await cur.execute(effect.statement, effect.params)
                answer = await cur.fetchone() if cur.description else None
        except psycopg.OperationalError:
            raise
        except Exception as error:
            if not effect.future.done():
                effect.future.set_exception(error)
            return
        if not effect.future.done():
            effect.future.set_result(answer)


__all__ = ["MAX_EFFECTS", "CoalescedEffects"]
