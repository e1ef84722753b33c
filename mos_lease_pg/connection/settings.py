"""How the store connects: :class:`ConnectionSettings` (timeouts, statement preparation,
the schema, the replication required, the call bound) and the keyword arguments a connection
is opened with (:func:`connect_kwargs`). Apart from the connection sources because the
settings are plain values that the commands, the notices listener and the pools read too.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Final

import attrs
import psycopg
from psycopg.conninfo import conninfo_to_dict

from mos_lease.errors import ConfigurationError
from mos_lease_pg import replication
from mos_lease_pg.sql_files import DEFAULT_SCHEMA, check_schema


def _positive_or_none(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, timedelta) or value <= timedelta(0)):
        raise ConfigurationError(f"{attr.name} must be a positive timedelta or None")


def _positive_seconds(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
            or not math.isfinite(value)):
        raise ConfigurationError(f"{attr.name} must be a positive number of seconds")


def _positive_seconds_or_none(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _positive_seconds(inst, attr, value)


def _flag(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{attr.name} must be True or False")

# With no statement timeout, the call bound still needs one to start from.
_UNTIMED_STATEMENT: Final = timedelta(seconds=30)


@attrs.frozen(slots=True)
class ConnectionSettings:
    """How the store connects and how long it lets the server work.

    ``statement_timeout`` bounds every statement and ``lock_timeout`` every row-lock wait;
    both errors roll the statement back and surface as ``StoreUnavailable``.
    ``connect_timeout`` (seconds, libpq rounds up to at least 2) bounds opening a connection
    and ``pool_timeout`` (seconds) waiting for a pooled one. ``prepare`` uses server-side
    prepared statements (turn it off behind a proxy that cannot track them).
    ``session_options`` sends the timeouts as libpq startup options. ``schema`` is where
    the tables are (every statement names it; the session's search_path is never used).

    ``call_timeout`` (seconds) bounds every store call on the client, whatever the network
    does (a silent or half-open peer, replies that never come): by then the call has
    returned or raised. ``None`` (the default) means ``statement_timeout`` + 1 s (31 s
    without a statement timeout); see :meth:`call_bound`. A write cut off this way raises
    ``CommitOutcomeUnknown`` and is reconciled; a read raises ``StoreUnavailable``. The
    bound counts from the call: the wait for the connection (its turn on a dedicated one, or
    the pool), opening a new one (given up at the deadline, whatever ``connect_timeout``
    says) and its checks are inside it, and a validation's denial shares its read's bound.

    ``require_synchronous_replication`` refuses (``ConfigurationError``, at first use) a
    primary whose commits do not wait for a synchronous standby, and makes reconcile call a
    found write committed only once it is durable on that standby (see
    :mod:`mos_lease_pg.replication`). ``standby_reads`` lets the store run on a standby, for
    reads only (the server refuses its writes); without it a store that lands on a standby
    is refused, and a DSN naming several hosts gets ``target_session_attrs=read-write``.

    ``audit_heartbeats`` (default True: audit everything) may be turned off by a
    high-volume deployment: a successful heartbeat then writes no audit row (at 10,000
    connectors every 10 s that is 86 million rows a day less). Every denial, including a
    denied heartbeat, and every acquire, takeover, release and grant is still audited. A
    successful heartbeat's event cannot be looked up then, so reconciling one whose reply
    was lost raises ``CommitOutcomeUnknown`` (a keeper retries it: renewing again is safe)
    in the process that sent it; see ``docs/audit-retention.md``.
    """

    statement_timeout: timedelta | None = attrs.field(default=timedelta(seconds=5),
                                                      validator=_positive_or_none)
    lock_timeout: timedelta | None = attrs.field(default=timedelta(seconds=2),
                                                 validator=_positive_or_none)
    connect_timeout: float = attrs.field(default=5.0, validator=_positive_seconds)
    pool_timeout: float = attrs.field(default=2.0, validator=_positive_seconds)
    prepare: bool = True
    session_options: bool = True
    application_name: str = "mos-lease"
    schema: str = attrs.field(default=DEFAULT_SCHEMA,
                              validator=lambda _i, a, v: check_schema(v, a.name))
    call_timeout: float | None = attrs.field(default=None,
                                             validator=_positive_seconds_or_none)
    require_synchronous_replication: bool = attrs.field(default=False, validator=_flag)
    standby_reads: bool = attrs.field(default=False, validator=_flag)
    audit_heartbeats: bool = attrs.field(default=True, validator=_flag)

    def call_bound(self) -> float:
        """The client-side bound of one call, in seconds (see ``call_timeout``)."""
        if self.call_timeout is not None:
            return float(self.call_timeout)
        statement = self.statement_timeout or _UNTIMED_STATEMENT
        return statement.total_seconds() + 1.0

    def options(self) -> list[str]:
        """The ``-c name=value`` startup options these settings send."""
        if not self.session_options:
            return []
        # Timestamps arrive in the session time zone and the core works in UTC: a UTC
        # session lets psycopg hand over datetimes already in ``timezone.utc`` (no zoneinfo
        # conversion per column, a few microseconds per lease row).
        flags = ["-c TimeZone=UTC"]
        for name, value in (("statement_timeout", self.statement_timeout),
                            ("lock_timeout", self.lock_timeout)):
            if value is not None:
                millis = max(1, round(value / timedelta(milliseconds=1)))
                flags.append(f"-c {name}={millis}")
        return flags


def connect_kwargs(conninfo: str, settings: ConnectionSettings) -> dict[str, Any]:
    """Keyword arguments for ``psycopg.connect(conninfo, **kwargs)`` or a pool's ``kwargs``.

    Options already in ``conninfo`` are kept; ours are appended after them.
    """
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as bad:
        raise ConfigurationError(f"invalid PostgreSQL connection string: {bad}") from None
    # prepare_threshold=0 prepares each statement on its first use (a prepared lookup is
    # ~22% faster); None disables server-side preparation altogether.
    kwargs: dict[str, Any] = {"autocommit": True,
                              "prepare_threshold": 0 if settings.prepare else None}
    options = " ".join(filter(None, [str(given.get("options") or ""), *settings.options()]))
    if options:
        kwargs["options"] = options
    if "connect_timeout" not in given:
        kwargs["connect_timeout"] = max(2, round(settings.connect_timeout))
    if "application_name" not in given:
        kwargs["application_name"] = settings.application_name
    kwargs.update(replication.connect_attrs(given, replication.needs_of(settings)))
    # The kernel's own bounds on a peer that stopped answering: unacknowledged data is given
    # up after the call bound, and an idle connection is probed. A DSN's values win.
    bound = settings.call_bound()
    for name, value in (("tcp_user_timeout", max(1, round(bound * 1000))), ("keepalives", 1),
                        ("keepalives_idle", max(1, round(bound))),
                        ("keepalives_interval", 1), ("keepalives_count", 3)):
        if name not in given:
            kwargs[name] = value
    return kwargs
