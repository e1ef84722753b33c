"""The stable vocabulary written to the audit log and read by operators.

String values are part of the public contract: they are stored in PostgreSQL and matched by
dashboards and alerts, so they are never renamed, only added.
"""

from __future__ import annotations

import enum


class LifecycleEvent(enum.StrEnum):
    """What an audit row records: the lifecycle operation attempted. Stable string values."""

    ACQUIRE = "acquire"
    HEARTBEAT = "heartbeat"
    TAKEOVER = "takeover"
    RELEASE = "release"
    GRANT_ISSUE = "grant_issue"
    GRANT_VALIDATE = "grant_validate"


class Outcome(enum.StrEnum):
    """How an audited attempt ended: what it did, or ``denied`` (with a :class:`Reason`).
    Stable string values."""

    ACQUIRED = "acquired"
    RENEWED = "renewed"
    TAKEN_OVER = "taken_over"
    RELEASED = "released"
    GRANT_ISSUED = "grant_issued"
    VALIDATED = "validated"
    DENIED = "denied"


class Reason(enum.StrEnum):
    """Why an operation was denied. Every member is provoked by at least one test."""

    # lease state
    LEASE_HELD = "lease_held"
    TAKEOVER_REQUIRED = "takeover_required"
    LEASE_MISSING = "lease_missing"
    LEASE_EXPIRED = "lease_expired"
    LEASE_RELEASED = "lease_released"
    LEASE_REPLACED = "lease_replaced"
    STALE_EPOCH = "stale_epoch"
    EPOCH_MISMATCH = "epoch_mismatch"
    EPOCH_EXHAUSTED = "epoch_exhausted"
    # store time (a write whose time is earlier than the row's latest stamp: the store's
    # clock stepped back, e.g. a failover to a host whose clock is behind)
    CLOCK_BEHIND = "clock_behind"
    # policy
    POLICY_DENIED = "policy_denied"
    PREEMPTION_DENIED = "preemption_denied"
    SCOPE_NOT_AUTHORIZED = "scope_not_authorized"
    TTL_NOT_AUTHORIZED = "ttl_not_authorized"
    # grants
    GRANT_UNKNOWN = "grant_unknown"
    GRANT_EXPIRED = "grant_expired"
    TENANT_MISMATCH = "tenant_mismatch"
    AGENT_MISMATCH = "agent_mismatch"
    BINDING_MISMATCH = "binding_mismatch"
    # infrastructure (validation fails closed)
    STORE_UNAVAILABLE = "store_unavailable"


class LeaseState(enum.StrEnum):
    """State of a durable lease row as judged at one instant of store time."""

    ACTIVE = "active"
    EXPIRED = "expired"
    RELEASED = "released"
