"""The ports: what the coordinator needs from the world, as small protocols.

A store is the only stateful port. It owns the time authority: every read and every write
reports the store's own time, and guards are evaluated against that time inside the same
atomic step, never against a gateway's clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol
from uuid import UUID

from mos_lease.identity import LeaseIdentity
from mos_lease.machine import Close, Insert, Renew, Rotate, Write
from mos_lease.records import AuditEntry, AuditRecord, LeaseRow, Snapshot, WriteOutcome

IdSource = Callable[[], UUID]
"""Makes the lease ids, event ids and grant ids; :func:`mos_lease.ids.uuid7` in production
(time-ordered: the PostgreSQL store requires it of event ids)."""


class LeaseStore(Protocol):
    """Synchronous durable store of lease rows and their audit log.

    Contract (checked for any store by :mod:`mos_lease.testing`):

    * ``load`` returns the current row of ``identity`` (or ``None``) and the store's time,
      read together.
    * ``apply`` checks ``write``'s guard against the current row at the store's time and, in
      one atomic step, applies it and appends ``entry`` with that time; if the guard fails it
      changes nothing and returns ``row=None``. Exactly
      :func:`mos_lease.machine.write_outcome` semantics.
    * ``renew_many`` renews a batch of heartbeats: each ``(renew, entry)`` as ``apply``
      would, in one round trip; a refused renewal does not affect the others. Outcomes come
      back in order. (It is how ``heartbeat_many`` is one round trip.) A store with row
      locks does not wait for a row another transaction holds: that renewal's outcome is
      ``WriteOutcome(None, now, reached=False)``, nothing written or audited for it, and
      the others are renewed.
    * Optionally, the batch operations of :class:`BatchLeaseStore`.
    * ``record`` appends one audit entry (a refusal or a grant issue) and returns nothing;
      the same entry sent again (its reply was lost) is kept once, not refused.
    * ``event_committed`` tells whether the attempt of audit entry ``event_id`` took effect:
      the entry exists and its outcome is not ``denied``
      (:func:`mos_lease.reconciliation.took_effect`; a refusal's entry carries the event id
      of the write it refused). It is how a write whose commit outcome was lost is
      reconciled.
    * Rows are never deleted and audit entries never changed or removed.

    Optional: a ``clock_can_step`` attribute, ``False`` for a store whose time no failover
    can move to another host's clock (the in-memory store). Keepers, ``hold()`` and the
    supervisor then add no clock-step margin (:func:`mos_lease.keeper.default_clock_step`);
    a store without it is treated as ``True``.

    Synchronous or asyncio is read from ``load``: a coroutine function makes an asyncio
    store, which only :class:`~mos_lease.AsyncConnectorLeaseCoordinator` takes; the
    coordinators refuse the other kind when they are built.

    Failures before the outcome is decided raise :class:`~mos_lease.errors.StoreUnavailable`;
    a write whose outcome is unknown raises :class:`~mos_lease.errors.CommitOutcomeUnknown`.
    """

    def load(self, identity: LeaseIdentity) -> Snapshot:
        """The identity's current row (or ``None``) and the store's time, read together."""

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        """Apply ``write`` if its guard holds against the current row, judged at the store's
        time read after the row is locked, and append ``entry`` in the same atomic step;
        a refused write changes nothing and returns ``WriteOutcome(None, now)`` (ideally
        with ``found``, the row it found)."""

    def renew_many(self, renewals: Sequence[tuple[Renew, AuditEntry]]
                   ) -> Sequence[WriteOutcome]:
        """Apply each renewal as :meth:`apply` would, in order, ideally in one round trip;
        return the outcomes in the same order (``reached=False`` for a row another
        transaction held locked, which is skipped rather than waited for)."""

    def record(self, entry: AuditEntry) -> None:
        """Append one audit entry (a refusal or a grant issue) on its own, stamped with the
        store's time; an event id is stored at most once (the same entry sent again is
        already done)."""

    def event_committed(self, event_id: UUID) -> bool:
        """Whether the audit entry ``event_id`` exists with an outcome other than ``denied``:
        how a write whose commit outcome was lost is reconciled."""


class BatchLeaseStore(LeaseStore, Protocol):
    """A :class:`LeaseStore` that also writes and reads in batches (both shipped stores do).

    The coordinator's ``acquire_many``, ``takeover_many``, ``release_many`` and
    ``current_holders`` use these when the store has them, one call per batch; on a store
    without them it makes the batch's calls one by one (``apply``, ``load``), with the same
    results. Contract (checked by :mod:`mos_lease.testing` when a store has them):

    * ``acquire_many``, ``takeover_many`` and ``release_many`` apply a batch of first
      acquisitions (``Insert``), takeovers (``Rotate``) or releases (``Close``) of distinct
      identities: each ``(write, entry)`` applied and audited as ``apply`` would, ideally in
      one round trip and one atomic step, a refused one affecting none of the others;
      outcomes in order. A takeover or release whose row another transaction holds locked
      need not be waited for: its outcome then has ``reached=False`` (nothing judged,
      written or audited) and the others go ahead.
    * ``load_many`` reads the rows of many identities at one store time, as ``load`` reads
      each, writing nothing.
    """

    def acquire_many(self, inserts: Sequence[tuple[Insert, AuditEntry]]
                     ) -> Sequence[WriteOutcome]:
        """Apply each first acquisition as :meth:`apply` would; the outcomes in order."""

    def takeover_many(self, rotations: Sequence[tuple[Rotate, AuditEntry]]
                      ) -> Sequence[WriteOutcome]:
        """Apply each takeover as :meth:`apply` would (or skip a row locked elsewhere:
        ``reached=False``); the outcomes in order."""

    def release_many(self, closes: Sequence[tuple[Close, AuditEntry]]
                     ) -> Sequence[WriteOutcome]:
        """Apply each release as :meth:`apply` would (or skip a row locked elsewhere:
        ``reached=False``); the outcomes in order."""

    def load_many(self, identities: Sequence[LeaseIdentity]) -> Sequence[Snapshot]:
        """Each identity's row (or ``None``), all read at one store time, in order."""


class AsyncLeaseStore(Protocol):
    """The asyncio twin of :class:`LeaseStore`, with the same contract."""

    async def load(self, identity: LeaseIdentity) -> Snapshot:
        """As :meth:`LeaseStore.load`."""

    async def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        """As :meth:`LeaseStore.apply`."""

    async def renew_many(self, renewals: Sequence[tuple[Renew, AuditEntry]]
                         ) -> Sequence[WriteOutcome]:
        """As :meth:`LeaseStore.renew_many`."""

    async def record(self, entry: AuditEntry) -> None:
        """As :meth:`LeaseStore.record`."""

    async def event_committed(self, event_id: UUID) -> bool:
        """As :meth:`LeaseStore.event_committed`."""


class AsyncBatchLeaseStore(AsyncLeaseStore, Protocol):
    """The asyncio twin of :class:`BatchLeaseStore`, with the same contract."""

    async def acquire_many(self, inserts: Sequence[tuple[Insert, AuditEntry]]
                           ) -> Sequence[WriteOutcome]:
        """As :meth:`BatchLeaseStore.acquire_many`."""

    async def takeover_many(self, rotations: Sequence[tuple[Rotate, AuditEntry]]
                            ) -> Sequence[WriteOutcome]:
        """As :meth:`BatchLeaseStore.takeover_many`."""

    async def release_many(self, closes: Sequence[tuple[Close, AuditEntry]]
                           ) -> Sequence[WriteOutcome]:
        """As :meth:`BatchLeaseStore.release_many`."""

    async def load_many(self, identities: Sequence[LeaseIdentity]) -> Sequence[Snapshot]:
        """As :meth:`BatchLeaseStore.load_many`."""


BATCH_METHODS = ("acquire_many", "takeover_many", "release_many", "load_many")
"""The methods of :class:`BatchLeaseStore` beyond :class:`LeaseStore`."""


MAX_AUDIT_PAGE = 1_000_000
"""The most audit records one ``audit`` call returns (its ``limit``)."""


class LeaseInspector(Protocol):
    """Read-only views for operators and tests (``mos-lease status`` / ``audit``)."""

    def leases(self, tenant_id: str | None = None) -> Sequence[LeaseRow]:
        """Every lease row (of ``tenant_id`` only, if given)."""

    def audit(self, identity: LeaseIdentity | None = None, *, after_seq: int = 0,
              limit: int = 1000) -> Sequence[AuditRecord]:
        """Audit records in sequence order, oldest first: those after ``after_seq`` (for
        paging), of ``identity`` only if given, at most ``limit``."""
