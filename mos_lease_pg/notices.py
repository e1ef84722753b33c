"""Push notices of takeovers and releases: ``LISTEN`` on the schema's channel.

A takeover or a release sends a PostgreSQL ``NOTIFY`` in its own transaction (see
``sql/statements/notify.sql``), so a waiter can look again at once and a holder can learn of
its loss before its next heartbeat. :class:`LeaseNotices` owns one dedicated connection
that listens, on a daemon thread, and calls the callbacks subscribed for an identity::

    notices = LeaseNotices(dsn)
    with hold(coordinator, identity, "claude-a", scopes=..., ttl=30, notices=notices):
        ...
    notices.close()

A notice is only a hint. Fencing never depends on one: the guarded writes decide, and a lost
or late notice only means the holder finds out at its next heartbeat, as without notices.
Anyone who can connect to the database can send ``NOTIFY`` on any channel (one statement
sends 50,000), so a notice never grants anything, and what it says is never believed: the
most it causes is a *confirming turn* (a holder reads its row, a waiter looks again). The
turns are coalesced per identity and rate-bounded for the process by a
:class:`~mos_lease.notice_confirmer.NoticeConfirmer` (``confirmer``; by default the
process's one, shared by every listener): at most one turn per identity in flight, at most
``burst + rate * T`` turns in any ``T`` seconds (10 + 20/s by default), one WARNING when a
flood makes the bound hold turns back, and the counts in :meth:`LeaseNotices.stats`. A
flood costs the listener's thread the parsing of each payload and nothing else: holders
keep renewing, validations keep their bound.

Where ``LISTEN`` cannot work, the listener logs one WARNING and stops, and everything goes
on by polling: waiters read at their backoff, holders find loss at the next heartbeat.
Behind a transaction-pooling proxy (PgBouncer ``pool_mode=transaction``) notices do not
reach the session that listened: give the listener a direct or session-pooled connection
string, or leave notices out. asyncio holders use this same thread-based listener (the
holder hands each notice to its loop).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any, Final

import psycopg
from psycopg import sql

from mos_lease.errors import InvalidInput
from mos_lease.identity import LeaseIdentity, check_identity
from mos_lease.notice_confirmer import NoticeConfirmer, shared_confirmer
from mos_lease.notice_gate import NoticeStats
from mos_lease_pg.connection import ConnectionSettings, connect_kwargs
from mos_lease_pg.sql_files import query_text
from mos_lease_pg.statements import NOTICE_KINDS, notice_channel

log = logging.getLogger("mos_lease_pg.notices")
_LISTEN: Final = sql.SQL(query_text("notices", "listen.sql"))

NoticeCallback = Callable[[int, str], object]
"""``callback(epoch, kind)``: the identity's lease is now at ``epoch``; ``kind`` is
``"takeover"`` or ``"release"``."""
AnyNoticeCallback = Callable[[LeaseIdentity, int, str], object]
"""``callback(identity, epoch, kind)``: as :data:`NoticeCallback`, for every identity (one
subscription for a supervisor of many bindings)."""

KINDS: Final = frozenset(NOTICE_KINDS.values())
_KEYS: Final = frozenset({"t", "a", "b", "e", "k"})
# How often the listening thread looks up from waiting to see whether it should stop: the
# longest close() waits for it.
POLL_SECONDS: Final = 0.2
MIN_RECONNECT: Final = 0.1
MAX_RECONNECT: Final = 10.0


def parse_notice(payload: str) -> tuple[LeaseIdentity, int, str] | None:
    """``(identity, epoch, kind)`` of a notice payload, or ``None`` for anything that is not
    exactly one (extra or missing keys, wrong types, an invalid identity)."""
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):  # a payload of 8000 "[" is deeper than json goes
        return None
    if not isinstance(data, dict) or data.keys() != _KEYS:
        return None
    epoch, kind = data["e"], data["k"]
    if type(epoch) is not int or epoch < 1 or kind not in KINDS:
        return None
    try:
        identity = LeaseIdentity(data["t"], data["a"], data["b"])
    except (InvalidInput, TypeError, ValueError):
        return None
    return identity, epoch, kind


class LeaseNotices:
    """One listening connection for the lease notices of ``settings.schema``.

    The thread starts at once. It reconnects with backoff after a lost connection (notices
    sent meanwhile are missed: holders still renew, waiters still poll). If ``LISTEN`` is
    refused it logs one WARNING and stops (``refused`` then says why). ``listening`` is set
    while the channel is listened to. Callbacks run on the listening thread for every
    well-formed notice, forged ones included; one that raises is logged and ignored. A
    callback must do no work of its own per notice: the holders' callbacks only ask
    ``confirmer`` for a turn. ``confirmer``: the confirmer holders given this source use
    (default: the process's, :func:`~mos_lease.notice_confirmer.shared_confirmer`). Use as
    a context manager, or call :meth:`close`.
    """

    def __init__(self, conninfo: str, *, settings: ConnectionSettings | None = None,
                 confirmer: NoticeConfirmer | None = None) -> None:
        if not isinstance(conninfo, str):
            raise InvalidInput("conninfo", f"must be a str, not {type(conninfo).__name__}")
        if settings is not None and not isinstance(settings, ConnectionSettings):
            raise InvalidInput("settings", "must be a ConnectionSettings or None")
        if confirmer is not None and not isinstance(confirmer, NoticeConfirmer):
            raise InvalidInput("confirmer", "must be a NoticeConfirmer or None")
        self.confirmer = confirmer if confirmer is not None else shared_confirmer()
        self.received = 0
        """Notices heard on the channel, well-formed or not."""
        self.malformed = 0
        """Of those, the ones dropped as not a lease notice."""
        self.settings = settings or ConnectionSettings()
        self._conninfo = conninfo
        self._kwargs = connect_kwargs(conninfo, self.settings)  # refuses a bad conninfo
        self._kwargs["autocommit"] = True  # a LISTEN inside an open transaction hears nothing
        self.channel = notice_channel(self.settings.schema)
        self._subscribers: dict[LeaseIdentity, list[NoticeCallback]] = {}
        self._everything: list[AnyNoticeCallback] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.listening = threading.Event()
        self.refused: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"mos-lease-notices {self.channel}")
        self._thread.start()

    # -- subscribers ---------------------------------------------------------------------

    def subscribe(self, identity: LeaseIdentity, callback: NoticeCallback) -> None:
        """Call ``callback(epoch, kind)`` on every notice for ``identity``."""
        checked = check_identity("identity", identity)
        if not callable(callback):
            raise InvalidInput("callback", f"must be callable, not {type(callback).__name__}")
        with self._lock:
            self._subscribers.setdefault(checked, []).append(callback)

    def unsubscribe(self, identity: LeaseIdentity, callback: NoticeCallback) -> None:
        """Stop calling ``callback`` for ``identity`` (nothing if it was not subscribed)."""
        checked = check_identity("identity", identity)
        with self._lock:
            callbacks = self._subscribers.get(checked, [])
            if callback in callbacks:
                callbacks.remove(callback)
            if not callbacks:
                self._subscribers.pop(checked, None)

    def subscribe_all(self, callback: AnyNoticeCallback) -> None:
        """Call ``callback(identity, epoch, kind)`` on every notice, whatever its identity:
        one subscription for a :class:`~mos_lease.supervisor.Supervisor`'s many bindings."""
        if not callable(callback):
            raise InvalidInput("callback", f"must be callable, not {type(callback).__name__}")
        with self._lock:
            self._everything.append(callback)

    def unsubscribe_all(self, callback: AnyNoticeCallback) -> None:
        """Stop calling ``callback`` (nothing if it was not subscribed)."""
        with self._lock:
            if callback in self._everything:
                self._everything.remove(callback)

    def stats(self) -> NoticeStats:
        """The counts of :attr:`confirmer` (shared by every source that uses it): notices
        handed to it, coalesced, confirming turns started, turns held back by the bound."""
        return self.confirmer.stats()

    def dispatch(self, payload: str) -> None:
        """Hand one payload to the subscribers of its identity (bad payloads are dropped)."""
        self.received += 1
        notice = parse_notice(payload)
        if notice is None:
            self.malformed += 1
            # Not ours, or forged: anyone who can connect may NOTIFY this channel. DEBUG,
            # and never the payload's text, which may be anything.
            log.debug("mos_lease: ignored a malformed lease notice (%d bytes)", len(payload))
            return
        identity, epoch, kind = notice
        with self._lock:
            callbacks = list(self._subscribers.get(identity, ()))
            everything = list(self._everything) if self._everything else ()
        for callback in callbacks:
            try:
                callback(epoch, kind)
            except Exception:
                log.exception("mos_lease: lease notice callback failed")
        for any_callback in everything:
            try:
                any_callback(identity, epoch, kind)
            except Exception:
                log.exception("mos_lease: lease notice callback failed")

    # -- the listening thread --------------------------------------------------------------

    def _run(self) -> None:
        delay = MIN_RECONNECT
        while not self._closing.is_set():
            try:
                conn = psycopg.connect(self._conninfo, **self._kwargs)
            except psycopg.Error as down:
                log.info("mos_lease: lease notices cannot connect (%s); retrying in %g s",
                         type(down).__name__, delay)
            else:
                with conn:
                    try:
                        conn.execute(_LISTEN.format(channel=sql.Identifier(self.channel)))
                    except psycopg.Error as refused:
                        if not conn.broken:
                            self._refuse(refused)
                            return
                        log.info("mos_lease: lease notice connection lost (%s); reconnecting",
                                 type(refused).__name__)
                    else:
                        delay = MIN_RECONNECT
                        self._receive(conn)
            self._closing.wait(delay)
            delay = min(delay * 2, MAX_RECONNECT)

    def _refuse(self, refused: psycopg.Error) -> None:
        # The server answered and said no (a pooler that refuses LISTEN, a role or setting
        # that forbids it): trying again would say no again. Polling is the way on.
        self.refused = f"{type(refused).__name__}: {refused}"
        log.warning("mos_lease: LISTEN %s refused (%s); lease notices are off: holders "
                    "find loss at their next heartbeat and waiters poll",
                    self.channel, self.refused)

    def _receive(self, conn: psycopg.Connection[Any]) -> None:
        self.listening.set()
        try:
            while not self._closing.is_set():
                for notify in conn.notifies(timeout=POLL_SECONDS):
                    if notify.channel == self.channel:
                        self.dispatch(notify.payload)
                    if self._closing.is_set():
                        break
        except psycopg.Error as lost:
            log.info("mos_lease: lease notice connection lost (%s); reconnecting",
                     type(lost).__name__)
        finally:
            self.listening.clear()

    def close(self, timeout: float = 5.0) -> None:
        """Stop listening and close the connection (waits up to ``timeout`` seconds)."""
        self._closing.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> LeaseNotices:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
