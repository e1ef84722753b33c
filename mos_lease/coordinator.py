"""The two coordinators: the asyncio and the synchronous facade over the same flows.

Everything a coordinator does is written once, as a flow (:mod:`mos_lease.flows`) that
yields store operations; a facade method only checks that it runs in its own process,
starts the flow and drives it against its store. :class:`AsyncConnectorLeaseCoordinator`
is the source. :class:`ConnectorLeaseCoordinator` below it is generated from it by
``tools/async_to_sync.py`` (drop ``async`` and ``await``, name the synchronous port), and
``tests/core/test_async_to_sync.py`` fails when the generated text is not current: a change
made to the one is made to the other.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Final, Generic, TypeVar
from uuid import UUID

from mos_lease.batch_flows import BatchFlows
from mos_lease.checks import check_adapter, check_async_adapter
from mos_lease.clock import MonotonicClock, default_clock
from mos_lease.context import ConnectorExecutionContext
from mos_lease.errors import ConfigurationError, MosLeaseError
from mos_lease.events import EventHook, emitter, store_system
from mos_lease.flow_options import DEFAULT_MAX_CONFLICT_RETRIES
from mos_lease.flowdrive import primed
from mos_lease.grants import ExecutionGrant
from mos_lease.identity import GRANT_TTL_CAP, LEASE_TTL_CAP, LeaseIdentity
from mos_lease.ids import uuid7
from mos_lease.observed import Observation
from mos_lease.operation import SHARED_START
from mos_lease.policy import ConnectorLeaseService
from mos_lease.ports import AsyncLeaseStore, IdSource, LeaseStore
from mos_lease.records import LeaseHandle
from mos_lease.results import (
    GrantResult,
    HolderView,
    InvocationResult,
    LeaseResult,
    RenewalResult,
    ValidationResult,
)
from mos_lease.stats import CoordinatorCounts, CoordinatorStats
from mos_lease.store_ops import Flow, perform, perform_async
from mos_lease.vocabulary import Reason

log = logging.getLogger("mos_lease")

T = TypeVar("T")
S = TypeVar("S")

_pid = os.getpid()


def _forked() -> None:
    global _pid  # noqa: PLW0603 - the one process-wide fact, kept current at fork
    _pid = os.getpid()


# Read once here and at each fork, rather than asked of the kernel on every validation.
os.register_at_fork(after_in_child=_forked)

_UNTIMED: Final = (0, 0.0)


def check_store_kind(store: object, coordinator: type[object], asynchronous: bool) -> None:
    """Refuse a store of the other kind than ``coordinator`` (asyncio when ``asynchronous``)
    when the coordinator is built, rather than at its first call (a coroutine where a
    snapshot was expected, or a snapshot awaited). The kind is read from the store's
    ``load``: a coroutine function makes an asyncio store."""
    load = getattr(store, "load", None)
    if not callable(load):
        raise ConfigurationError(f"{coordinator.__name__} needs a lease store (an object with "
                                 f"load(), apply(), ...), not {type(store).__name__}")
    if inspect.iscoroutinefunction(load) == asynchronous:
        return
    name = type(store).__name__
    if asynchronous:
        raise ConfigurationError(
            f"{name} is a synchronous store (its load() is not a coroutine function) and "
            f"{coordinator.__name__} needs an asyncio one: use ConnectorLeaseCoordinator "
            "with it, or an asyncio store (AsyncInMemoryLeaseStore, AsyncPostgresLeaseStore)")
    raise ConfigurationError(
        f"{name} is an asyncio store (its load() is a coroutine function) and "
        f"{coordinator.__name__} needs a synchronous one: use AsyncConnectorLeaseCoordinator "
        "with it, or a synchronous store (InMemoryLeaseStore, PostgresLeaseStore)")


class _Coordinator(Generic[S]):
    """What both coordinators share: the flows, the options and the process they live in."""

    _run: Callable[..., Any]  # each facade's driver: a coroutine function in the asyncio one

    def __init__(
        self,
        store: S,
        policy: ConnectorLeaseService | None = None,
        *,
        lease_ttl_cap: timedelta | float = LEASE_TTL_CAP,
        grant_ttl_cap: timedelta | float = GRANT_TTL_CAP,
        id_source: IdSource = uuid7,
        max_conflict_retries: int = DEFAULT_MAX_CONFLICT_RETRIES,
        monotonic_clock: MonotonicClock = default_clock,
        on_event: EventHook | None = None,
    ) -> None:
        # The facade's own _run tells its kind: the asyncio one is a coroutine function.
        check_store_kind(store, type(self), inspect.iscoroutinefunction(type(self)._run))
        self.store = store
        self._emit = emitter(on_event)
        self._flows = BatchFlows(policy, lease_ttl_cap=lease_ttl_cap,
                                 grant_ttl_cap=grant_ttl_cap, id_source=id_source,
                                 max_conflict_retries=max_conflict_retries,
                                 monotonic_clock=monotonic_clock)
        self._system = store_system(store)
        # Whether the store counts its calls' bounds from SHARED_START (operation.py).
        self._shares_bound = getattr(store, "shares_bound", False) is True
        self._pid = _pid
        self._counts = CoordinatorCounts()

    def stats(self) -> CoordinatorStats:
        """The operations asked of this coordinator since it was created, by kind and
        outcome (:class:`mos_lease.stats.CoordinatorStats`)."""
        counts = self._counts
        return CoordinatorStats({k: dict(v) for k, v in list(counts.finished.items())},
                                dict(counts.denials), dict(counts.failed))

    def _observation(self) -> Observation | None:
        if self._emit is None:  # the one check telemetry costs when nothing listens
            return None
        return Observation(self._emit, self._flows.monotonic, self._system)

    @property
    def monotonic(self) -> MonotonicClock:
        """The monotonic clock this coordinator measures in-flight time on; keepers and
        holders built on it keep their deadlines on the same clock unless told otherwise."""
        return self._flows.monotonic

    @property
    def live_grants(self) -> int:
        """How many grants this instance remembers; expired ones are dropped."""
        return len(self._flows.grants)

    def _foreign_process(self) -> bool:
        # Registries are wiped in a forked child; this also covers a coordinator object
        # that reached another process by any other route.
        if self._pid == _pid:
            return False
        log.info("mos_lease: validation denied: coordinator used in another process than "
                 "the one that built it (reason=%s)", Reason.GRANT_UNKNOWN)
        return True


class AsyncConnectorLeaseCoordinator(_Coordinator[AsyncLeaseStore]):
    """The asyncio coordinator. One instance per gateway process.

    ``store`` is the lease store (``mos_lease_memory.AsyncInMemoryLeaseStore`` in one
    process, ``mos_lease_pg.AsyncPostgresLeaseStore`` across processes); a store of the
    other kind is refused here with a :class:`~mos_lease.errors.ConfigurationError` naming
    the coordinator it needs. ``policy`` defaults to deny-all. The TTL caps
    (``lease_ttl_cap``: 5 minutes, ``grant_ttl_cap``: 30 seconds) may only be lowered.
    ``id_source`` makes the lease, event and grant ids (default :func:`mos_lease.ids.uuid7`:
    time-ordered, as the PostgreSQL store requires of event ids);
    ``max_conflict_retries`` bounds the reads and writes of one operation that keeps losing
    races (default 8); ``monotonic_clock`` measures time in flight. ``on_event`` (default
    ``None``) is called with a :mod:`mos_lease.events` event for every store call and every
    finished lifecycle attempt or validation (``docs/telemetry.md``).
    """

    async def _run(self, flow: Flow[T], operation: str) -> T:
        """Drive ``flow``: perform each store operation it yields and send it the answer, or
        throw in the store's error, until it returns its result (counted under
        ``operation``, the public method's name)."""
        seen = self._observation()
        answer: Any = None
        failure: MosLeaseError | None = None
        while True:
            try:
                op = flow.send(answer) if failure is None else flow.throw(failure)
            except StopIteration as done:
                self._counts.finish(operation, done.value)
                if seen is not None:
                    seen.finish(done.value)
                return done.value  # type: ignore[no-any-return]
            except BaseException:
                self._counts.fail(operation)
                raise
            started = _UNTIMED if seen is None else seen.start(op)
            try:
                answer, failure = await perform_async(self.store, op), None
            except BaseException as error:
                if seen is not None:
                    seen.called(op, started, error)
                if not isinstance(error, MosLeaseError):
                    raise  # a bug or a cancellation: raised on, never into the flow
                answer, failure = None, error
            else:
                if seen is not None:
                    seen.called(op, started, None)

    async def acquire(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                      ttl: timedelta | float, correlation_id: str | None = None,
                      metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """Insert-only first acquisition (epoch 1). Never recovers an expired or released
        lease: that needs :meth:`takeover`.

        ``metadata`` is a small ``str -> str`` payload the holder shows to whoever reads the
        lease (``current_holder()``, ``mos-lease status``), such as the endpoint a gateway
        routes this binding's requests to; never audited (:mod:`mos_lease.metadata` has its
        bounds). Heartbeats and the release keep it."""
        return await self._run(self._flows.acquire(
            identity, connector_id, scopes, ttl, correlation_id, metadata), "acquire")

    async def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                       ttl: timedelta | float, expected_epoch: int,
                       correlation_id: str | None = None,
                       observed: HolderView | None = None,
                       metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """Compare-and-set on ``expected_epoch``: rotates the lease id, epoch + 1.

        The policy is told the lease's current state and holder, which costs a read before
        the write, unless ``observed`` is the :class:`HolderView` this coordinator just
        returned for the identity at ``expected_epoch`` (``current_holder()``, or a refused
        acquire's ``result.holder``): then the takeover is one round trip. ``metadata``
        replaces the previous holder's, as for :meth:`acquire` (``None``: none)."""
        return await self._run(self._flows.takeover(
            identity, connector_id, scopes, ttl, expected_epoch, correlation_id, observed,
            metadata), "takeover")

    async def heartbeat(self, lease: LeaseHandle, *, ttl: timedelta | float,
                        correlation_id: str | None = None) -> LeaseResult:
        """Extend an active lease to store time + ``ttl``; full match on every field."""
        return await self._run(self._flows.heartbeat(lease, ttl, correlation_id), "heartbeat")

    async def heartbeat_many(self, leases: Sequence[LeaseHandle], *, ttl: timedelta | float,
                             correlation_id: str | None = None) -> list[LeaseResult]:
        """Renew many leases in one store round trip; results are in the order given, and
        each lease is matched, refused and audited on its own. A lease whose row another
        transaction holds locked (a fenced transaction of a long tool) is not waited for:
        its result is ``store_unavailable`` (nothing written or audited; try it again, as
        after a transient failure) and the others are renewed."""
        return await self._run(self._flows.heartbeat_many(leases, ttl, correlation_id),
                               "heartbeat_many")

    def prime_heartbeat_many(self, leases: Sequence[LeaseHandle], *, ttl: timedelta | float,
                             correlation_id: str | None = None
                             ) -> Callable[[], Awaitable[list[LeaseResult]]]:
        """:meth:`heartbeat_many` in two halves. The leases are checked and the batch is
        built now, on the calling thread (bad input raises here); calling what this returns
        makes the store call and judges each result, exactly as :meth:`heartbeat_many`
        does. Call it once. A driver that renews many batches primes the next one while
        the last one's statement runs (the thread supervisor does)."""
        return functools.partial(self._run,
                                 primed(self._flows.heartbeat_many(leases, ttl, correlation_id)),
                                 "heartbeat_many")

    async def release(self, lease: LeaseHandle, *,
                      correlation_id: str | None = None) -> LeaseResult:
        """Release an active lease, keeping its epoch; only a takeover follows it."""
        return await self._run(self._flows.release(lease, correlation_id), "release")

    async def acquire_many(self, identities: Sequence[LeaseIdentity], connector_id: str, *,
                           scopes: object, ttl: timedelta | float,
                           correlation_id: str | None = None,
                           metadata: Mapping[str, str] | None = None) -> list[LeaseResult]:
        """:meth:`acquire` for many identities never held (at most 1,000, each once): the
        writes the policy allows go to the store in one round trip, each inserted, refused
        (``lease_held``, ``takeover_required``) and audited on its own. Results are in the
        order given."""
        return await self._run(self._flows.acquire_many(
            identities, connector_id, scopes, ttl, correlation_id, metadata), "acquire_many")

    async def takeover_many(self, targets: Sequence[tuple[LeaseIdentity, int]],
                            connector_id: str, *, scopes: object, ttl: timedelta | float,
                            correlation_id: str | None = None,
                            observed: Sequence[HolderView | None] | None = None,
                            metadata: Mapping[str, str] | None = None) -> list[LeaseResult]:
        """:meth:`takeover` for many ``(identity, expected_epoch)`` targets (at most 1,000,
        each identity once): each a compare-and-set on its own epoch, judged by the policy
        on its own, with its own new lease UUID and audit row, all written in one round
        trip. ``observed`` may give, per target, the :class:`HolderView` this coordinator
        returned for it (:meth:`current_holders`); the targets without one are read
        together first. A target whose row another transaction holds locked is not
        waited for: its result is ``store_unavailable`` (nothing written; try again)."""
        return await self._run(self._flows.takeover_many(
            targets, connector_id, scopes, ttl, correlation_id, observed, metadata),
            "takeover_many")

    async def release_many(self, leases: Sequence[LeaseHandle], *,
                           correlation_id: str | None = None) -> list[LeaseResult]:
        """:meth:`release` for many leases (at most 1,000, each identity once) in one round
        trip, each matched, refused and audited on its own; a lease whose row another
        transaction holds locked is ``store_unavailable``, as in :meth:`takeover_many`."""
        return await self._run(self._flows.release_many(leases, correlation_id),
                               "release_many")

    async def issue_grant(self, lease: LeaseHandle, *, scopes: object, ttl: timedelta | float,
                          correlation_id: str | None = None) -> GrantResult:
        """Mint a short-lived, process-local grant after rereading the current lease."""
        return await self._run(self._flows.issue_grant(lease, scopes, ttl, correlation_id),
                               "issue_grant")

    async def validate(self, grant: ExecutionGrant, *, identity: LeaseIdentity, scopes: object,
                       correlation_id: str | None = None) -> ValidationResult:
        """Check ``grant`` against the store right now, for work on ``identity`` needing
        ``scopes``. Prefer :meth:`invoke`, which leaves no gap before the adapter runs."""
        if self._foreign_process():
            denied = ValidationResult(Reason.GRANT_UNKNOWN)
            self._counts.finish("validate", denied)
            return denied
        flow = self._flows.validate(grant, identity, scopes, correlation_id)
        if not self._shares_bound:
            return await self._run(flow, "validate")
        # The read and a denial's audit append share one bound (operation.py); set and
        # reset inline rather than through a context manager: this is the hottest call.
        started = SHARED_START.set(time.monotonic())
        try:
            return await self._run(flow, "validate")
        finally:
            SHARED_START.reset(started)

    async def renew_grant(self, grant: ExecutionGrant, *, identity: LeaseIdentity,
                          scopes: object, ttl: timedelta | float,
                          correlation_id: str | None = None) -> RenewalResult:
        """Renew a running tool's grant: reread the lease and, if ``grant`` is still valid
        for ``identity`` and ``scopes`` (as :meth:`validate` judges it, with the same
        reasons), mint its successor with a fresh expiry (store time + ``ttl``, never past
        the lease's) and the context to hand the tool. Asks the policy and audits one
        ``grant_issue`` row, as :meth:`issue_grant`. Renew before ``grant`` expires: an
        expired grant is refused (``grant_expired``), and so is every grant once the lease
        moved on (``stale_epoch``, ``lease_replaced``, ``lease_released``, ...)."""
        if self._foreign_process():
            refused = RenewalResult(Reason.GRANT_UNKNOWN, "unrecognized")
            self._counts.finish("renew_grant", refused)
            return refused
        return await self._run(
            self._flows.renew_grant(grant, identity, scopes, ttl, correlation_id), "renew_grant")

    async def invoke(self, grant: ExecutionGrant,
                     adapter: Callable[[ConnectorExecutionContext], Awaitable[T]], *,
                     identity: LeaseIdentity, scopes: object,
                     correlation_id: str | None = None) -> InvocationResult[T]:
        """Validate ``grant`` for ``identity`` and ``scopes``, then call ``adapter`` with the
        context and nothing else; a refusal returns an ``InvocationResult`` with its reason
        and never calls the adapter."""
        check_async_adapter(adapter)
        checked = await self.validate(grant, identity=identity, scopes=scopes,
                                      correlation_id=correlation_id)
        if checked.context is None:
            return InvocationResult(checked.reason)
        return InvocationResult(None, checked.context, await adapter(checked.context))

    async def current_holder(self, identity: LeaseIdentity) -> HolderView | None:
        """Who holds ``identity``'s lease now (``None`` if it never had one). A read: no
        audit row, no lease UUID, no scopes. Stored metadata that breaks the rules a write
        passes is withheld (``metadata_invalid``; :mod:`mos_lease.metadata`)."""
        return await self._run(self._flows.current_holder(identity), "current_holder")

    async def current_holders(self, identities: Sequence[LeaseIdentity]
                              ) -> list[HolderView | None]:
        """:meth:`current_holder` for many identities (at most 1,000) in one round trip, all
        read at one store time; in the order given. A read: no audit row."""
        return await self._run(self._flows.current_holders(identities),
                               "current_holders")

    async def reconcile(self, identity: LeaseIdentity, event_id: UUID) -> bool:
        """Whether the write behind a :class:`CommitOutcomeUnknown` took effect."""
        return await self._run(self._flows.reconcile(identity, event_id), "reconcile")


# --- generated by tools/async_to_sync.py from the class above: do not edit ---


class ConnectorLeaseCoordinator(_Coordinator[LeaseStore]):
    """The synchronous coordinator. One instance per gateway process.

    ``store`` is the lease store (``mos_lease_memory.InMemoryLeaseStore`` in one
    process, ``mos_lease_pg.PostgresLeaseStore`` across processes); a store of the
    other kind is refused here with a :class:`~mos_lease.errors.ConfigurationError` naming
    the coordinator it needs. ``policy`` defaults to deny-all. The TTL caps
    (``lease_ttl_cap``: 5 minutes, ``grant_ttl_cap``: 30 seconds) may only be lowered.
    ``id_source`` makes the lease, event and grant ids (default :func:`mos_lease.ids.uuid7`:
    time-ordered, as the PostgreSQL store requires of event ids);
    ``max_conflict_retries`` bounds the reads and writes of one operation that keeps losing
    races (default 8); ``monotonic_clock`` measures time in flight. ``on_event`` (default
    ``None``) is called with a :mod:`mos_lease.events` event for every store call and every
    finished lifecycle attempt or validation (``docs/telemetry.md``).
    """

    def _run(self, flow: Flow[T], operation: str) -> T:
        """Drive ``flow``: perform each store operation it yields and send it the answer, or
        throw in the store's error, until it returns its result (counted under
        ``operation``, the public method's name)."""
        seen = self._observation()
        answer: Any = None
        failure: MosLeaseError | None = None
        while True:
            try:
                op = flow.send(answer) if failure is None else flow.throw(failure)
            except StopIteration as done:
                self._counts.finish(operation, done.value)
                if seen is not None:
                    seen.finish(done.value)
                return done.value  # type: ignore[no-any-return]
            except BaseException:
                self._counts.fail(operation)
                raise
            started = _UNTIMED if seen is None else seen.start(op)
            try:
                answer, failure = perform(self.store, op), None
            except BaseException as error:
                if seen is not None:
                    seen.called(op, started, error)
                if not isinstance(error, MosLeaseError):
                    raise  # a bug or a cancellation: raised on, never into the flow
                answer, failure = None, error
            else:
                if seen is not None:
                    seen.called(op, started, None)

    def acquire(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                ttl: timedelta | float, correlation_id: str | None = None,
                metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """Insert-only first acquisition (epoch 1). Never recovers an expired or released
        lease: that needs :meth:`takeover`.

        ``metadata`` is a small ``str -> str`` payload the holder shows to whoever reads the
        lease (``current_holder()``, ``mos-lease status``), such as the endpoint a gateway
        routes this binding's requests to; never audited (:mod:`mos_lease.metadata` has its
        bounds). Heartbeats and the release keep it."""
        return self._run(self._flows.acquire(
            identity, connector_id, scopes, ttl, correlation_id, metadata), "acquire")

    def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                 ttl: timedelta | float, expected_epoch: int,
                 correlation_id: str | None = None,
                 observed: HolderView | None = None,
                 metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """Compare-and-set on ``expected_epoch``: rotates the lease id, epoch + 1.

        The policy is told the lease's current state and holder, which costs a read before
        the write, unless ``observed`` is the :class:`HolderView` this coordinator just
        returned for the identity at ``expected_epoch`` (``current_holder()``, or a refused
        acquire's ``result.holder``): then the takeover is one round trip. ``metadata``
        replaces the previous holder's, as for :meth:`acquire` (``None``: none)."""
        return self._run(self._flows.takeover(
            identity, connector_id, scopes, ttl, expected_epoch, correlation_id, observed,
            metadata), "takeover")

    def heartbeat(self, lease: LeaseHandle, *, ttl: timedelta | float,
                  correlation_id: str | None = None) -> LeaseResult:
        """Extend an active lease to store time + ``ttl``; full match on every field."""
        return self._run(self._flows.heartbeat(lease, ttl, correlation_id), "heartbeat")

    def heartbeat_many(self, leases: Sequence[LeaseHandle], *, ttl: timedelta | float,
                       correlation_id: str | None = None) -> list[LeaseResult]:
        """Renew many leases in one store round trip; results are in the order given, and
        each lease is matched, refused and audited on its own. A lease whose row another
        transaction holds locked (a fenced transaction of a long tool) is not waited for:
        its result is ``store_unavailable`` (nothing written or audited; try it again, as
        after a transient failure) and the others are renewed."""
        return self._run(self._flows.heartbeat_many(leases, ttl, correlation_id),
                         "heartbeat_many")

    def prime_heartbeat_many(self, leases: Sequence[LeaseHandle], *, ttl: timedelta | float,
                             correlation_id: str | None = None
                             ) -> Callable[[], list[LeaseResult]]:
        """:meth:`heartbeat_many` in two halves. The leases are checked and the batch is
        built now, on the calling thread (bad input raises here); calling what this returns
        makes the store call and judges each result, exactly as :meth:`heartbeat_many`
        does. Call it once. A driver that renews many batches primes the next one while
        the last one's statement runs (the thread supervisor does)."""
        return functools.partial(self._run,
                                 primed(self._flows.heartbeat_many(leases, ttl, correlation_id)),
                                 "heartbeat_many")

    def release(self, lease: LeaseHandle, *,
                correlation_id: str | None = None) -> LeaseResult:
        """Release an active lease, keeping its epoch; only a takeover follows it."""
        return self._run(self._flows.release(lease, correlation_id), "release")

    def acquire_many(self, identities: Sequence[LeaseIdentity], connector_id: str, *,
                     scopes: object, ttl: timedelta | float,
                     correlation_id: str | None = None,
                     metadata: Mapping[str, str] | None = None) -> list[LeaseResult]:
        """:meth:`acquire` for many identities never held (at most 1,000, each once): the
        writes the policy allows go to the store in one round trip, each inserted, refused
        (``lease_held``, ``takeover_required``) and audited on its own. Results are in the
        order given."""
        return self._run(self._flows.acquire_many(
            identities, connector_id, scopes, ttl, correlation_id, metadata), "acquire_many")

    def takeover_many(self, targets: Sequence[tuple[LeaseIdentity, int]],
                      connector_id: str, *, scopes: object, ttl: timedelta | float,
                      correlation_id: str | None = None,
                      observed: Sequence[HolderView | None] | None = None,
                      metadata: Mapping[str, str] | None = None) -> list[LeaseResult]:
        """:meth:`takeover` for many ``(identity, expected_epoch)`` targets (at most 1,000,
        each identity once): each a compare-and-set on its own epoch, judged by the policy
        on its own, with its own new lease UUID and audit row, all written in one round
        trip. ``observed`` may give, per target, the :class:`HolderView` this coordinator
        returned for it (:meth:`current_holders`); the targets without one are read
        together first. A target whose row another transaction holds locked is not
        waited for: its result is ``store_unavailable`` (nothing written; try again)."""
        return self._run(self._flows.takeover_many(
            targets, connector_id, scopes, ttl, correlation_id, observed, metadata),
            "takeover_many")

    def release_many(self, leases: Sequence[LeaseHandle], *,
                     correlation_id: str | None = None) -> list[LeaseResult]:
        """:meth:`release` for many leases (at most 1,000, each identity once) in one round
        trip, each matched, refused and audited on its own; a lease whose row another
        transaction holds locked is ``store_unavailable``, as in :meth:`takeover_many`."""
        return self._run(self._flows.release_many(leases, correlation_id),
                         "release_many")

    def issue_grant(self, lease: LeaseHandle, *, scopes: object, ttl: timedelta | float,
                    correlation_id: str | None = None) -> GrantResult:
        """Mint a short-lived, process-local grant after rereading the current lease."""
        return self._run(self._flows.issue_grant(lease, scopes, ttl, correlation_id),
                         "issue_grant")

    def validate(self, grant: ExecutionGrant, *, identity: LeaseIdentity, scopes: object,
                 correlation_id: str | None = None) -> ValidationResult:
        """Check ``grant`` against the store right now, for work on ``identity`` needing
        ``scopes``. Prefer :meth:`invoke`, which leaves no gap before the adapter runs."""
        if self._foreign_process():
            denied = ValidationResult(Reason.GRANT_UNKNOWN)
            self._counts.finish("validate", denied)
            return denied
        flow = self._flows.validate(grant, identity, scopes, correlation_id)
        if not self._shares_bound:
            return self._run(flow, "validate")
        # The read and a denial's audit append share one bound (operation.py); set and
        # reset inline rather than through a context manager: this is the hottest call.
        started = SHARED_START.set(time.monotonic())
        try:
            return self._run(flow, "validate")
        finally:
            SHARED_START.reset(started)

    def renew_grant(self, grant: ExecutionGrant, *, identity: LeaseIdentity,
                    scopes: object, ttl: timedelta | float,
                    correlation_id: str | None = None) -> RenewalResult:
        """Renew a running tool's grant: reread the lease and, if ``grant`` is still valid
        for ``identity`` and ``scopes`` (as :meth:`validate` judges it, with the same
        reasons), mint its successor with a fresh expiry (store time + ``ttl``, never past
        the lease's) and the context to hand the tool. Asks the policy and audits one
        ``grant_issue`` row, as :meth:`issue_grant`. Renew before ``grant`` expires: an
        expired grant is refused (``grant_expired``), and so is every grant once the lease
        moved on (``stale_epoch``, ``lease_replaced``, ``lease_released``, ...)."""
        if self._foreign_process():
            refused = RenewalResult(Reason.GRANT_UNKNOWN, "unrecognized")
            self._counts.finish("renew_grant", refused)
            return refused
        return self._run(
            self._flows.renew_grant(grant, identity, scopes, ttl, correlation_id), "renew_grant")

    def invoke(self, grant: ExecutionGrant,
               adapter: Callable[[ConnectorExecutionContext], T], *,
               identity: LeaseIdentity, scopes: object,
               correlation_id: str | None = None) -> InvocationResult[T]:
        """Validate ``grant`` for ``identity`` and ``scopes``, then call ``adapter`` with the
        context and nothing else; a refusal returns an ``InvocationResult`` with its reason
        and never calls the adapter."""
        check_adapter(adapter)
        checked = self.validate(grant, identity=identity, scopes=scopes,
                                correlation_id=correlation_id)
        if checked.context is None:
            return InvocationResult(checked.reason)
        return InvocationResult(None, checked.context, adapter(checked.context))

    def current_holder(self, identity: LeaseIdentity) -> HolderView | None:
        """Who holds ``identity``'s lease now (``None`` if it never had one). A read: no
        audit row, no lease UUID, no scopes. Stored metadata that breaks the rules a write
        passes is withheld (``metadata_invalid``; :mod:`mos_lease.metadata`)."""
        return self._run(self._flows.current_holder(identity), "current_holder")

    def current_holders(self, identities: Sequence[LeaseIdentity]
                        ) -> list[HolderView | None]:
        """:meth:`current_holder` for many identities (at most 1,000) in one round trip, all
        read at one store time; in the order given. A read: no audit row."""
        return self._run(self._flows.current_holders(identities),
                         "current_holders")

    def reconcile(self, identity: LeaseIdentity, event_id: UUID) -> bool:
        """Whether the write behind a :class:`CommitOutcomeUnknown` took effect."""
        return self._run(self._flows.reconcile(identity, event_id), "reconcile")
