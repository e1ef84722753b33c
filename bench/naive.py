"""The naive implementation the library is compared with: a careful hand-rolled version
without a single-statement design.

Each operation is one explicit transaction of separate statements: BEGIN, SELECT ... FOR
UPDATE (the row and the database clock), the guard checked in Python, UPDATE (or INSERT) of
the lease row, INSERT of the audit row, COMMIT. Every statement is prepared like the
library's, and it runs on the same connection, so the difference is the design (five round
trips instead of one), not the driver settings.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import psycopg

from mos_lease import LeaseIdentity
from mos_lease.identity import MAX_EPOCH
from mos_lease.ids import uuid7
from mos_lease.vocabulary import LifecycleEvent, Outcome

_LOCK = b"""
SELECT t.now, l.lease_id, l.connector_id, l.epoch, l.released_at, l.expires_at
FROM (SELECT clock_timestamp() AS now) AS t
LEFT JOIN LATERAL (
    SELECT lease_id, connector_id, epoch, released_at, expires_at
    FROM mos_lease.logical_agent_connector_leases
    WHERE tenant_id = %(tenant_id)s AND logical_agent_id = %(logical_agent_id)s
      AND binding_id = %(binding_id)s
    FOR UPDATE
) AS l ON true
"""

_KEY = (b" WHERE tenant_id = %(tenant_id)s AND logical_agent_id = %(logical_agent_id)s"
        b" AND binding_id = %(binding_id)s")

_RENEW = (b"UPDATE mos_lease.logical_agent_connector_leases SET heartbeat_at = %(now)s,"
          b" expires_at = %(now)s + %(ttl)s::interval, updated_at = %(now)s" + _KEY)

_CLOSE = (b"UPDATE mos_lease.logical_agent_connector_leases SET released_at = %(now)s,"
          b" updated_at = %(now)s" + _KEY)

_ROTATE = (b"UPDATE mos_lease.logical_agent_connector_leases SET lease_id = %(new_lease_id)s,"
           b" epoch = epoch + 1, connector_id = %(connector_id)s,"
           b" allowed_scopes = %(scopes)s::text[], acquired_at = %(now)s,"
           b" heartbeat_at = %(now)s, expires_at = %(now)s + %(ttl)s::interval,"
           b" released_at = NULL, updated_at = %(now)s" + _KEY)

_INSERT = b"""
INSERT INTO mos_lease.logical_agent_connector_leases
    (tenant_id, logical_agent_id, binding_id, lease_id, connector_id, allowed_scopes, epoch,
     acquired_at, heartbeat_at, expires_at, released_at, updated_at)
VALUES (%(tenant_id)s, %(logical_agent_id)s, %(binding_id)s, %(new_lease_id)s,
        %(connector_id)s, %(scopes)s::text[], 1, %(now)s, %(now)s,
        %(now)s + %(ttl)s::interval, NULL, %(now)s)
ON CONFLICT DO NOTHING
"""

_AUDIT = b"""
INSERT INTO mos_lease.connector_lease_audit_log
    (event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id, connector_id,
     epoch, correlation_id, recorded_at)
VALUES (%(event_id)s, %(event)s, %(outcome)s, NULL, %(tenant_id)s, %(logical_agent_id)s,
        %(binding_id)s, %(connector_id)s, %(epoch)s, %(correlation_id)s, clock_timestamp())
"""


class NaiveRefused(Exception):
    """The naive guard did not hold: the benchmark set up something wrong."""


def _key(identity: LeaseIdentity) -> dict[str, object]:
    return {"tenant_id": identity.tenant_id, "logical_agent_id": identity.logical_agent_id,
            "binding_id": identity.binding_id}


class Naive:
    """The four lifecycle writes, naively, on one autocommit connection."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def _lock(self, key: dict[str, object]) -> tuple[Any, ...]:
        row: tuple[Any, ...] | None = self.conn.execute(_LOCK, key, prepare=True).fetchone()
        assert row is not None
        return row

    def _audit(self, key: dict[str, object], event: LifecycleEvent, outcome: Outcome,
               connector_id: str, epoch: int, now: datetime) -> None:
        # Stamped by the database clock in the INSERT itself: the schema refuses an audit
        # stamp read by an earlier statement (migration 0004). ``now`` stamps the lease.
        del now
        self.conn.execute(_AUDIT, {**key, "event_id": uuid7(), "event": event.value,
                                   "outcome": outcome.value, "connector_id": connector_id,
                                   "epoch": epoch, "correlation_id": uuid4().hex},
                          prepare=True)

    @staticmethod
    def _active(row: tuple[Any, ...]) -> bool:
        now, lease_id, _connector, _epoch, released_at, expires_at = row
        return lease_id is not None and released_at is None and expires_at > now

    @staticmethod
    def _holds(row: tuple[Any, ...], connector_id: str, lease_id: UUID, epoch: int) -> bool:
        return (row[1] == lease_id and row[2] == connector_id and row[3] == epoch
                and Naive._active(row))

    def acquire(self, identity: LeaseIdentity, connector_id: str, scopes: list[str],
                ttl: timedelta) -> UUID:
        key = _key(identity)
        lease_id = uuid4()
        with self.conn.transaction():
            row = self._lock(key)
            if row[1] is not None:
                raise NaiveRefused("acquire: a row exists")
            self.conn.execute(_INSERT, {**key, "new_lease_id": lease_id,
                                        "connector_id": connector_id, "scopes": scopes,
                                        "ttl": ttl, "now": row[0]}, prepare=True)
            self._audit(key, LifecycleEvent.ACQUIRE, Outcome.ACQUIRED, connector_id, 1, row[0])
        return lease_id

    def heartbeat(self, identity: LeaseIdentity, connector_id: str, lease_id: UUID, epoch: int,
                  ttl: timedelta) -> None:
        key = _key(identity)
        with self.conn.transaction():
            row = self._lock(key)
            if not self._holds(row, connector_id, lease_id, epoch):
                raise NaiveRefused("heartbeat: not the active holder")
            self.conn.execute(_RENEW, {**key, "now": row[0], "ttl": ttl}, prepare=True)
            self._audit(key, LifecycleEvent.HEARTBEAT, Outcome.RENEWED, connector_id, epoch,
                        row[0])

    def release(self, identity: LeaseIdentity, connector_id: str, lease_id: UUID,
                epoch: int) -> None:
        key = _key(identity)
        with self.conn.transaction():
            row = self._lock(key)
            if not self._holds(row, connector_id, lease_id, epoch):
                raise NaiveRefused("release: not the active holder")
            self.conn.execute(_CLOSE, {**key, "now": row[0]}, prepare=True)
            self._audit(key, LifecycleEvent.RELEASE, Outcome.RELEASED, connector_id, epoch,
                        row[0])

    def takeover(self, identity: LeaseIdentity, connector_id: str, scopes: list[str],
                 ttl: timedelta, expected_epoch: int, preempt_active: bool) -> UUID:
        key = _key(identity)
        lease_id = uuid4()
        with self.conn.transaction():
            row = self._lock(key)
            if (row[1] is None or row[3] != expected_epoch or row[3] >= MAX_EPOCH
                    or (self._active(row) and not preempt_active)):
                raise NaiveRefused("takeover: compare-and-set failed")
            self.conn.execute(_ROTATE, {**key, "new_lease_id": lease_id,
                                        "connector_id": connector_id, "scopes": scopes,
                                        "ttl": ttl, "now": row[0]}, prepare=True)
            self._audit(key, LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER, connector_id,
                        expected_epoch + 1, row[0])
        return lease_id
