"""Running on a replicated PostgreSQL: a primary with a synchronous standby, and failover.

A lease survives a failover only if every write a caller was told about is on the standby
that gets promoted. PostgreSQL gives that with synchronous replication (a commit waits until
a synchronous standby has flushed it), with two holes this module closes:

* **A cancelled wait reports success.** A commit waiting for the standby that is cancelled
  (``pg_cancel_backend``, or the store's own client-side deadline, which cancels before it
  gives up on a call) returns ``INSERT 0 1`` / the rows, with only a WARNING notice
  (SQLSTATE ``01000``: "canceling wait for synchronous replication ... The transaction has
  already committed locally, but might not have been replicated to the standby"). Such a
  write may vanish at the next failover. :func:`watch` listens for notices on a connection
  (psycopg's public ``add_notice_handler``) and :func:`confirm`, called after every
  statement, turns a flagged write into ``CommitOutcomeUnknown`` and any other flagged call
  into ``StoreUnavailable``. ``statement_timeout`` does not bound that wait at all; only the
  store's ``call_timeout`` does.
* **Reconciling finds a write that is only local.** A write whose reply was lost may have
  committed on the primary without reaching the standby. When the deployment requires
  synchronous replication, reconcile calls a found event committed only once
  :func:`durability_barrier` succeeded: a transaction of its own that writes one WAL record
  (a transactional ``pg_logical_emit_message``, executable by every role, and changing no
  table), so that its commit waits for the synchronous standby like any write (a
  transaction that only took an id, ``pg_current_xact_id()``, was measured not to wait: a
  commit waits only if its transaction wrote WAL). WAL is flushed on the standby in order,
  so once the barrier's commit is confirmed, every commit before it (the found event's
  included) is on the standby. A barrier whose wait is cut off is flagged like any call,
  and the outcome stays unknown (``StoreUnavailable``). (Comparing ``pg_current_wal_lsn()`` with
  ``pg_stat_replication.flush_lsn`` says the same, but those columns are hidden from roles
  without ``pg_read_all_stats``, which the gateway role does not have.)

The first-use check (:mod:`mos_lease_pg.preflight`) reads the server's replication facts
with :data:`FACTS`, logs them once and judges them with :func:`judge`: a store is never
used for writes on a standby, and ``require_synchronous_replication`` refuses a primary whose
commits do not wait for a synchronous standby. Every later new connection (a reconnect after
a failover lands on another server) is judged again by :func:`recheck`, one round trip of
:data:`FACTS` and no schema check; there a refusal is ``StoreUnavailable`` (the connection is
not used, and the next call tries again): a new primary often runs without a synchronous
standby for a while, until its HA manager attaches one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol
from weakref import WeakKeyDictionary

import attrs
import psycopg
from psycopg.errors import Diagnostic

from mos_lease.errors import CommitOutcomeUnknown, ConfigurationError, StoreUnavailable
from mos_lease_pg.rows import Row
from mos_lease_pg.sql_files import Statement, statement_text
from mos_lease_pg.statements import Call, Kind
from mos_lease_pg.translate import statement_failure

log = logging.getLogger("mos_lease_pg")

Conn = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]

# The settings of ``synchronous_commit`` under which a commit returns only once a
# synchronous standby has flushed it (``on``) or also replayed it (``remote_apply``).
# ``remote_write`` waits only until the standby's operating system has the data (lost if
# that machine fails too), ``local`` and ``off`` wait for no standby: all below ``on``.
WAITING_COMMITS: Final = frozenset({"on", "remote_apply"})
# PostgreSQL reports a cancelled synchronous-replication wait with a WARNING of SQLSTATE
# 01000 (no code of its own), and an ended one (pg_terminate_backend, shutdown) with a
# WARNING of 57P01 before the connection closes. Any WARNING is taken as "not confirmed":
# the store's statements raise none otherwise, the message text is translated with
# lc_messages, and a false alarm costs only a reconcile, never a lost write.
_WARNING: Final = "WARNING"
MULTI_HOST_ATTRS: Final = {"target_session_attrs": "read-write"}


@attrs.frozen(slots=True)
class Needs:
    """What a store requires of the server (from ``ConnectionSettings``)."""

    synchronous: bool = False  # require_synchronous_replication
    standby_reads: bool = False  # a store on a standby is allowed (its writes are refused)


NO_NEEDS: Final = Needs()


class _Settings(Protocol):
    @property
    def require_synchronous_replication(self) -> bool: ...

    @property
    def standby_reads(self) -> bool: ...


def needs_of(settings: _Settings) -> Needs:
    """The needs a ``ConnectionSettings`` states."""
    return Needs(settings.require_synchronous_replication, settings.standby_reads)


@attrs.frozen(slots=True)
class ReplicationFacts:
    """What the first-use check found about the server's replication."""

    primary: bool  # not in recovery: may take writes
    synchronous_commit: str
    synchronous_standby_names: str


FACTS: Final = statement_text("replication_facts.sql").encode("utf-8")


def facts(row: Row) -> ReplicationFacts:
    primary, commit, names = row
    return ReplicationFacts(bool(primary), str(commit), str(names))


def judge(found: ReplicationFacts, needs: Needs, *, server: str) -> ReplicationFacts:
    """Log the facts once (INFO) and refuse what ``needs`` rules out
    (``ConfigurationError``, naming the fix)."""
    log.info("mos-lease store on %s: %s, synchronous_commit=%s, synchronous_standby_names=%r",
             server, "primary" if found.primary else "standby (in recovery)",
             found.synchronous_commit, found.synchronous_standby_names)
    if not found.primary and not needs.standby_reads:
        raise ConfigurationError(
            f"the store connected to a standby ({server}, in recovery): it never writes "
            "there. Name every node in the DSN with target_session_attrs=read-write "
            "(host=a,b port=p1,p2 target_session_attrs=read-write), or set "
            "standby_reads=True for a read-only store")
    if needs.synchronous and found.primary:
        if found.synchronous_standby_names.strip() == "":
            raise ConfigurationError(
                f"require_synchronous_replication: the primary {server} has no synchronous "
                "standby (synchronous_standby_names is empty), so an acknowledged write "
                "may be lost in a failover; configure one, or turn the setting off")
        if found.synchronous_commit not in WAITING_COMMITS:
            raise ConfigurationError(
                f"require_synchronous_replication: synchronous_commit is "
                f"{found.synchronous_commit!r} for this role on {server}, so commits do not "
                "wait until the synchronous standby flushed them; set it to 'on' (ALTER "
                "ROLE ... SET synchronous_commit = on)")
    return found


def _server(conn: Conn) -> str:
    return f"{conn.info.host}:{conn.info.port}"


def _rejudge(row: Row | None, needs: Needs, server: str) -> ReplicationFacts:
    assert row is not None
    try:
        return judge(facts(row), needs, server=server)
    except ConfigurationError as refused:
        # The store was accepted at first use: what changed is the server behind the DSN,
        # which its HA manager may yet fix (a standby attached to a new primary).
        raise StoreUnavailable(f"refused a new connection: {refused}") from None


def recheck(conn: psycopg.Connection[Any], needs: Needs) -> ReplicationFacts:
    """Judge a store's new connection (not its first: :mod:`mos_lease_pg.preflight` checks
    that one) against ``needs``; ``StoreUnavailable`` if it falls short or fails."""
    try:
        row = conn.execute(FACTS, prepare=False).fetchone()
    except psycopg.Error as exc:
        raise statement_failure(exc, what="replication check", write_event=None).error from exc
    return _rejudge(row, needs, _server(conn))


async def recheck_async(conn: psycopg.AsyncConnection[Any], needs: Needs) -> ReplicationFacts:
    """The asyncio twin of :func:`recheck`."""
    try:
        row = await (await conn.execute(FACTS, prepare=False)).fetchone()
    except psycopg.Error as exc:
        raise statement_failure(exc, what="replication check", write_event=None).error from exc
    return _rejudge(row, needs, _server(conn))


def connect_attrs(given: Mapping[str, object], needs: Needs) -> dict[str, str]:
    """Connection parameters to add to a DSN: a DSN naming several hosts gets
    ``target_session_attrs=read-write`` unless it chose one (or the store may read from a
    standby), so that libpq connects to whichever node is the primary now."""
    hosts = str(given.get("host") or given.get("hostaddr") or "")
    if "," not in hosts or "target_session_attrs" in given or needs.standby_reads:
        return {}
    return dict(MULTI_HOST_ATTRS)


# --- the acknowledgement of a commit -----------------------------------------------------


class _Flag:
    """The warnings a connection received since they were last looked at."""

    __slots__ = ("__weakref__", "warnings")

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def __call__(self, notice: Diagnostic) -> None:
        if notice.severity_nonlocalized == _WARNING:
            text = notice.message_primary or ""
            self.warnings.append(f"{text} (sqlstate {notice.sqlstate})")


_FLAGS: WeakKeyDictionary[Any, _Flag] = WeakKeyDictionary()
_FLAGS_LOCK: Final = threading.Lock()


def watch(conn: Conn) -> _Flag:
    """Start listening for an unconfirmed commit on ``conn``: the handler is added once per
    connection and its flag cleared. The store keeps the flag with the connection's sender
    and looks at ``flag.warnings`` after each statement (:func:`confirm` clears them)."""
    flag = _FLAGS.get(conn)
    if flag is None:
        with _FLAGS_LOCK:
            flag = _FLAGS.get(conn)
            if flag is None:
                flag = _FLAGS[conn] = _Flag()
                conn.add_notice_handler(flag)
    flag.warnings.clear()
    return flag


def unconfirmed(conn: Conn) -> str | None:
    """The warning(s) ``conn`` received since :func:`watch`, if any (then cleared)."""
    flag = _FLAGS.get(conn)
    if flag is None or not flag.warnings:
        return None
    text = "; ".join(flag.warnings)
    flag.warnings.clear()
    return text


def confirm(conn: Conn, calls: Sequence[Call[Any]]) -> None:
    """Raise if the statement just sent for ``calls`` (one call, or the writes of a batch)
    reported success with a warning: ``CommitOutcomeUnknown`` for a write, an idempotent one
    included (its commit may not be on the synchronous standby; reconcile decides),
    ``StoreUnavailable`` for a read."""
    warning = unconfirmed(conn)
    if warning is None:
        return
    first = calls[0]
    what = first.what if len(calls) == 1 else f"batch of {len(calls)} writes"
    detail = (f"{what} returned with a warning, so its commit is not confirmed on the "
              f"synchronous standby: {warning}")
    # An idempotent write (an audit append) committed locally too: it may survive the
    # failover as well as vanish, so it is as unknown as any write, never "nothing changed".
    if first.kind is not Kind.READ and first.event_id is not None:
        raise CommitOutcomeUnknown(first.event_id, detail)
    raise StoreUnavailable(f"{detail}; the outcome stays unknown")


# --- durability of a found event ---------------------------------------------------------

BARRIER: Final = Statement.of("durability_barrier", statement_text("durability_barrier.sql"))


def _barrier_passed(rows: Sequence[Row]) -> None:
    names = str(rows[0][2]) if len(rows) == 1 else ""
    if names.strip() == "":
        raise StoreUnavailable(
            "the primary has no synchronous standby (synchronous_standby_names is empty): "
            "a found write cannot be confirmed durable, so its outcome stays unknown")


def durability_barrier() -> Call[None]:
    """The call that, once it returned without a warning (:func:`confirm`), proves every
    commit before it is on a synchronous standby. A read for the store's purposes: sent
    again after a lost connection, never reconciled."""
    return Call("durability barrier", BARRIER, {}, _barrier_passed)
