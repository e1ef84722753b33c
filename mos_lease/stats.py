"""Counters for sizing a deployment: what a store, a coordinator and a supervisor did since
they were created, read with their ``stats()`` method as a frozen snapshot.

Counting is always on, so it must cost next to nothing: each count is a plain integer
increment (an attribute ``+= 1`` or one dict entry) on a path that runs anyway, made where
the library already holds whatever lock that path holds; no lock is taken for a count and
nothing is allocated for one. The mutable tallies (:class:`StoreCounts`,
:class:`CoordinatorCounts`, :class:`SupervisorCounts`) are private to their owner; only the
snapshots (:class:`StoreStats`, :class:`CoordinatorStats`, :class:`SupervisorStats`) are
handed out. Where threads share an object without a lock (a synchronous PostgreSQL store
over a pool, say), two increments that race can, rarely, count as one: the figures are for
sizing, not for accounting. ``docs/telemetry.md`` says how to read them;
:mod:`mos_lease.otel` publishes them as OpenTelemetry observable instruments.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import attrs

from mos_lease.results import GrantResult, LeaseResult, RenewalResult, ValidationResult


def _frozen_counts(counts: Mapping[str, int]) -> Mapping[str, int]:
    # Keys may be counted as the results' StrEnum members: shown as their plain values.
    return MappingProxyType({str(key): n for key, n in counts.items()})


def _frozen_table(table: Mapping[str, Mapping[str, int]]
                  ) -> Mapping[str, Mapping[str, int]]:
    return MappingProxyType({str(key): _frozen_counts(row) for key, row in table.items()})


def _sum(counts: Mapping[str, int]) -> int:
    return sum(counts.values())


# -- store ------------------------------------------------------------------------------


class StoreCounts:
    """A store's running tallies (see :class:`StoreStats` for what each means)."""

    __slots__ = ("in_doubt", "reconciles", "sent")

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.in_doubt = 0
        self.reconciles = 0


@attrs.frozen(slots=True)
class StoreStats:
    """What a lease store sent, since it was created.

    ``round_trips``: statements sent to the database, by statement (``load``, ``load_many``,
    ``insert``/``renew``/``close``/``rotate`` for a single write, ``renew_many``,
    ``acquire_many``, ``takeover_many``, ``release_many``, ``record``, ``record_many``,
    ``record_matches``, ``event_committed``, ...); a resend after a lost connection counts
    again. The in-memory store counts each call as one, under the same names.
    ``load_batches`` / ``loads_batched``: the coalesced reads that carried the loads queued
    behind one in flight, and how many loads they carried (so ``loads_batched /
    load_batches`` is loads per coalesced read; a load that went out alone, or a batch of
    one, is a ``load`` round trip, a batch of more a ``load_many`` one); ``record_batches``
    / ``records_batched`` the same for audit appends (``record`` / ``record_many``).
    ``commit_outcome_unknown``: statements whose commit outcome was lost (a
    :class:`~mos_lease.errors.CommitOutcomeUnknown` raised, once per statement);
    ``reconciles``: ``event_committed`` calls that settled a write in doubt."""

    round_trips: Mapping[str, int] = attrs.field(factory=dict, converter=_frozen_counts)
    load_batches: int = 0
    loads_batched: int = 0
    record_batches: int = 0
    records_batched: int = 0
    commit_outcome_unknown: int = 0
    reconciles: int = 0

    @property
    def round_trips_total(self) -> int:
        """Every statement sent."""
        return _sum(self.round_trips)


# -- coordinator ------------------------------------------------------------------------

OK: Final = "ok"
"""The outcome counted for a validation or grant renewal that passed."""
DENIED: Final = "denied"
"""The outcome counted for one that was refused (its reasons: ``CoordinatorStats.denials``)."""


class CoordinatorCounts:
    """A coordinator's running tallies (see :class:`CoordinatorStats`)."""

    __slots__ = ("denials", "failed", "finished")

    def __init__(self) -> None:
        # operation -> outcome -> count; the outcome strings are the results' own enum
        # values, so counting one allocates nothing.
        self.finished: dict[str, dict[str, int]] = {}
        self.denials: dict[str, int] = {}
        self.failed: dict[str, int] = {}

    def finish(self, operation: str, result: object) -> None:
        """Count ``operation`` (a coordinator method's name) ending with ``result``."""
        cls = result.__class__
        if cls is ValidationResult or cls is RenewalResult:
            reason = result.reason  # type: ignore[attr-defined]
            outcome: str = OK if reason is None else DENIED
        elif cls is LeaseResult or cls is GrantResult:
            outcome = result.outcome  # type: ignore[attr-defined]
            reason = result.reason  # type: ignore[attr-defined]
        else:  # a batch (a list of results), a holder view, a reconcile's answer
            outcome, reason = OK, None
        by_outcome = self.finished.get(operation)
        if by_outcome is None:
            by_outcome = self.finished[operation] = {}
        by_outcome[outcome] = by_outcome.get(outcome, 0) + 1
        if reason is not None:
            self.denials[reason] = self.denials.get(reason, 0) + 1

    def fail(self, operation: str) -> None:
        """Count ``operation`` ending with an exception (a store error, a bad argument)."""
        self.failed[operation] = self.failed.get(operation, 0) + 1


@attrs.frozen(slots=True)
class CoordinatorStats:
    """What a coordinator's callers asked of it, since it was created.

    ``operations``: per operation (``validate``, ``issue_grant``, ``acquire``,
    ``takeover``, ``heartbeat``, ``heartbeat_many``, ``release``, ...), how many ended with
    each outcome: ``ok`` or ``denied`` for a validation and a grant renewal, the
    :class:`~mos_lease.vocabulary.Outcome` value (``acquired``, ``grant_issued``,
    ``denied``...) for a lease operation or a grant issue, ``ok`` for a call answered with a
    batch of results or a view. ``denials``: refusals by
    :class:`~mos_lease.vocabulary.Reason` value, over every operation. ``failed``: calls
    that raised (``StoreUnavailable``, ``CommitOutcomeUnknown``, bad input), by operation."""

    operations: Mapping[str, Mapping[str, int]] = attrs.field(factory=dict,
                                                              converter=_frozen_table)
    denials: Mapping[str, int] = attrs.field(factory=dict, converter=_frozen_counts)
    failed: Mapping[str, int] = attrs.field(factory=dict, converter=_frozen_counts)

    def count(self, operation: str, outcome: str | None = None) -> int:
        """How many ``operation`` calls ended with ``outcome`` (any outcome if ``None``;
        calls that raised are in :attr:`failed`)."""
        outcomes = self.operations.get(operation, {})
        return _sum(outcomes) if outcome is None else outcomes.get(outcome, 0)


# -- supervisor -------------------------------------------------------------------------


class SupervisorCounts:
    """A supervisor's running tallies (see :class:`SupervisorStats`)."""

    __slots__ = ("acquires", "campaign_reads", "hedges", "last_renewed", "notices",
                 "releases", "renewal_ticks", "renewed", "takeovers")

    def __init__(self) -> None:
        self.renewal_ticks = 0
        self.renewed = 0
        self.last_renewed = 0
        self.campaign_reads = 0
        self.acquires = 0
        self.takeovers = 0
        self.releases = 0
        self.notices = 0
        self.hedges = 0

    def renewal(self, leases: int) -> None:
        """A renewal batch of ``leases`` leases went out."""
        self.renewal_ticks += 1
        self.renewed += leases
        self.last_renewed = leases


@attrs.frozen(slots=True)
class SupervisorStats:
    """What a supervisor did, since it was created, and what it holds now.

    ``renewal_ticks``: renewal batches sent (one ``heartbeat_many`` each);
    ``leases_renewed``: leases they carried in all, ``last_renewed`` in the latest one (so
    ``leases_renewed / renewal_ticks`` is leases per tick). ``campaign_reads``: holder reads
    (bindings read: a campaign's batched reads count each binding, as does a notice's
    confirming read); ``acquires``, ``takeovers``, ``releases``: those attempted, one per
    binding whether sent alone or in a batch (won or not). ``notices``: lease notices about
    one of its bindings that were acted on (a waiting binding's next read moved earlier, or a
    confirming read asked for a held one). ``bindings``: registered now;
    ``bindings_held``: of them, holding a lease now (both gauges). ``renewal_hedges``:
    renewal batches sent again on the other of two renewal coordinators, a batch still
    running at half its time (``docs/keeping.md``; not in ``renewal_ticks``): above zero,
    one renewal connection, or the database, is slow."""

    renewal_ticks: int = 0
    leases_renewed: int = 0
    last_renewed: int = 0
    campaign_reads: int = 0
    acquires: int = 0
    takeovers: int = 0
    releases: int = 0
    notices: int = 0
    bindings: int = 0
    bindings_held: int = 0
    renewal_hedges: int = 0


__all__ = ["DENIED", "OK", "CoordinatorCounts", "CoordinatorStats", "StoreCounts",
           "StoreStats", "SupervisorCounts", "SupervisorStats"]
