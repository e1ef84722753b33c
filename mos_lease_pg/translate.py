"""Driver errors become the library's typed errors here, and nowhere else.

The one question that matters is whether a statement could have taken effect:

* failing to get a connection (connect error, pool exhausted or closed) happens before
  anything was sent: :class:`~mos_lease.errors.StoreUnavailable`;
* an error the server *reported* for a statement (a timeout, a lock timeout, a missing
  table, a privilege) means its transaction rolled back, since every statement runs in its
  own transaction: :class:`~mos_lease.errors.StoreUnavailable`, or
  :class:`~mos_lease.errors.InternalInconsistency` when the schema refused the data (a bug,
  never a state of the world); a write whose event id the database has applied already
  (an earlier attempt committed) is :class:`~mos_lease.errors.CommitOutcomeUnknown`, which
  the coordinator reconciles;
* a connection lost while a statement was in flight leaves a write's outcome unknown:
  :class:`~mos_lease.errors.CommitOutcomeUnknown`, reconciled by the coordinator through the
  write's audit event. For a read it is just :class:`~mos_lease.errors.StoreUnavailable`;
* a transaction pooler that refuses the store's startup options, or whose shared server
  sessions collide with the store's prepared statements, is a
  :class:`~mos_lease.errors.ConfigurationError` naming :data:`POOLER_SETTINGS`: no retry
  can help.
"""

from __future__ import annotations

import re
from typing import Final
from uuid import UUID

import attrs
import psycopg
import psycopg_pool

from mos_lease.errors import (
    CommitOutcomeUnknown,
    ConfigurationError,
    InternalInconsistency,
    MosLeaseError,
    StoreUnavailable,
)

# Server-side states that end the session rather than the statement: the server went away
# (shutdown, crash, pg_terminate_backend, idle-session timeout) and may or may not have
# committed what it was doing.
_SESSION_ENDING = frozenset({"57P01", "57P02", "57P03", "57P05"})
# Undefined table, schema, column or function, and insufficient privilege: configuration.
_MISCONFIGURED = frozenset({"42P01", "3F000", "42703", "42883", "42501"})
# What a store behind a transaction pooler (PgBouncer and the like) must be built with: the
# pooler hands each transaction to any of its server sessions, so nothing may live in one.
POOLER_SETTINGS: Final = "ConnectionSettings(session_options=False, prepare=False)"
# PgBouncer's refusal of libpq's ``options`` (where the store sends its timeouts). It comes
# as the text of a failed connection, without a SQLSTATE.
_REFUSED_OPTIONS: Final = "unsupported startup parameter"
# Prepared statement already exists: psycopg names its statements per connection, so the
# server session already holding one was prepared by another client sharing it.
_SHARED_SESSION: Final = "42P05"


def pooler_misconfigured(detail: str) -> ConfigurationError:
    """The error for a store whose settings do not suit the transaction pooler in front of
    the server; ``detail`` says how the pooler showed itself."""
    return ConfigurationError(
        f"{detail}: the store reaches PostgreSQL through a transaction pooler (PgBouncer or "
        f"the like), which refuses or drops startup options and shares server sessions "
        f"between clients; build the store with {POOLER_SETTINGS} and set statement_timeout "
        "and lock_timeout on the role instead (`mos-lease roles` does; `mos-lease check "
        "--behind-pooler` verifies)")


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` means the connection is gone, not that a statement failed."""
    if isinstance(exc, psycopg.InterfaceError):
        return True  # e.g. "the connection is closed": nothing left to talk to
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in _SESSION_ENDING


def _describe(exc: BaseException) -> str:
    state = getattr(exc, "sqlstate", None)
    # The first line of the message: libpq adds hints and context on later lines.
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{text} (sqlstate {state})" if state else text


def _describe_fatal(exc: BaseException) -> str:
    # libpq puts the server's FATAL last: "connection to server at ... failed: FATAL: ...".
    text = " ".join(str(exc).split())
    return text[text.rfind("FATAL:"):] if "FATAL:" in text else _describe(exc)


def unavailable_on_checkout(exc: BaseException, *,
                            pool_timeout: float) -> StoreUnavailable | ConfigurationError:
    """Getting a connection failed; nothing was sent. A pooler refusing the startup options
    is a :class:`ConfigurationError` (:func:`pooler_misconfigured`)."""
    if isinstance(exc, psycopg_pool.PoolTimeout):
        return StoreUnavailable(
            f"PostgreSQL pool exhausted: no connection became free within {pool_timeout:g} s")
    if isinstance(exc, psycopg_pool.PoolClosed):
        return StoreUnavailable("PostgreSQL pool is closed")
    if isinstance(exc, psycopg_pool.TooManyRequests):
        return StoreUnavailable("PostgreSQL pool refused the request: too many waiting")
    if isinstance(exc, psycopg.OperationalError) and _REFUSED_OPTIONS in str(exc):
        return pooler_misconfigured(f"cannot connect to PostgreSQL: {_describe_fatal(exc)}")
    return StoreUnavailable(f"cannot connect to PostgreSQL: {_describe(exc)}")


@attrs.frozen(slots=True)
class Failure:
    """A translated statement failure."""

    error: MosLeaseError
    connection_lost: bool


# The primary key of the event ids claimed (migration 0004), and each audit partition's
# unique index on event_id, named by PostgreSQL "<partition>_event_id_idx[N]" (migration
# 0009): either refuses an id applied twice.
EVENT_CLAIM: Final = "connector_lease_event_ids_pkey"
_EVENT_INDEX: Final = re.compile(r"connector_lease_audit_log_\w*_event_id_idx\d*")
# The CHECK holding a new audit row's event id to version 7, minted near its month (0009).
EVENT_TIME: Final = "connector_lease_audit_log_event_id_time"


def _already_applied(exc: psycopg.Error) -> bool:
    if not isinstance(exc, psycopg.errors.UniqueViolation):
        return False
    name = exc.diag.constraint_name or ""
    return name == EVENT_CLAIM or _EVENT_INDEX.fullmatch(name) is not None


# The schema's checks of a row's stamp against the clock, in their refusals' text: an audit
# row's (migration 0004), and a lease row's (0002, and 0007 after it).
_STAMPS_OFF_THE_CLOCK: Final = ("audit rows are stamped by the database clock",
                                "a write is stamped no later than the database clock")


def clock_stepped(exc: psycopg.Error) -> bool:
    """Whether the schema refused an audit row because its stamp lies outside the run of
    its own statement, or a lease row because its stamp lies after the database clock. The
    library stamps every row with the database clock inside that statement, so this is the
    clock stepping back (or forward) while the statement ran, between the stamp and the
    check; the server reported it, so the statement rolled back and wrote nothing, and
    sending it once more reads the clock again."""
    message = exc.diag.message_primary or ""
    return (isinstance(exc, psycopg.errors.RestrictViolation)
            and any(text in message for text in _STAMPS_OFF_THE_CLOCK))


def _event_id_refused(exc: psycopg.Error) -> bool:
    return (isinstance(exc, psycopg.errors.CheckViolation)
            and exc.diag.constraint_name == EVENT_TIME)


def statement_failure(exc: psycopg.Error, *, what: str, write_event: UUID | None) -> Failure:
    """Translate an error raised while a statement was sent or its result read.

    ``write_event`` is the audit event of a (non-idempotent) write, ``None`` otherwise.
    """
    lost = connection_lost(exc)
    detail = _describe(exc)
    error: MosLeaseError
    if lost and write_event is not None:
        error = CommitOutcomeUnknown(write_event, f"connection lost during {what}: {detail}")
    elif lost:
        error = StoreUnavailable(f"connection lost during {what}: {detail}")
    elif write_event is not None and _already_applied(exc):
        # The database applies an event id at most once (migration 0004): an earlier attempt
        # of this very write committed. Reconciling it finds that attempt's audit row.
        error = CommitOutcomeUnknown(
            write_event, f"{what} refused: event {write_event} is applied already (an "
            f"earlier attempt of this write committed): {detail}")
    elif _event_id_refused(exc):
        # Nothing was written. The id source or the gateway's clock is wrong, not the store:
        # every write would be refused the same way, so it must not look transient.
        error = ConfigurationError(
            f"{what} refused: its audit event id is not a time-ordered (version 7) UUID "
            "minted within a day of the database clock's month: give the coordinator an "
            "id_source of such ids (the default, mos_lease.ids.uuid7) and keep the gateway's "
            f"clock near the database's (`mos-lease check` reports the offset): {detail}")
    elif clock_stepped(exc):
        # Nothing was written; a step back is answered clock_behind by the next attempt.
        # Refused again (this is the resent statement's refusal): the clock stepped once
        # more, or the stamps run ahead of it, as no statement of the library's does.
        error = StoreUnavailable(f"{what} refused: its stamps lie outside the database "
                                 f"clock (it stepped while the statement ran; nothing was "
                                 f"written): {detail}")
    elif isinstance(exc, psycopg.IntegrityError):
        error = InternalInconsistency(f"the schema refused the {what}: {detail}")
    elif exc.sqlstate == _SHARED_SESSION:
        error = pooler_misconfigured(f"{what} failed: {detail}")
    elif exc.sqlstate in _MISCONFIGURED:
        # The schema or a grant went away after the store's first-use check (preflight.py):
        # no retry can help, so it must not look transient (keepers retry StoreUnavailable).
        error = ConfigurationError(
            f"{what} failed: {detail}: the schema or this role's privileges changed; run "
            "`mos-lease migrate --schema ...` as the owner and the roles step (roles.sql)")
    else:
        # Statement timeout (57014), lock timeout (55P03), read-only standby (25006), out of
        # resources (53...): the statement's transaction rolled back, so nothing changed.
        error = StoreUnavailable(f"{what} failed: {detail}")
    return Failure(error, lost)
