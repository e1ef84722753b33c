"""The stateful specification's concurrent rules: several validations, or several grant
issues, across bindings at once on threads that start together (overlapping reads and audit
appends, which a store may serve with one statement), with a rival's takeover racing them.
Each call is judged as if alone, before or after the takeover, with its own audit row.

:class:`Waves` is a mixin of the machine :func:`~mos_lease.testing.make_lease_machine`
builds; it uses the machine's gateways, model and bookkeeping, declared below.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from mos_lease.coordinator import ConnectorLeaseCoordinator
from mos_lease.grants import ExecutionGrant
from mos_lease.identity import LeaseIdentity
from mos_lease.machine import grant_refusal
from mos_lease.records import AuditRecord, LeaseHandle
from mos_lease.testing.harness import StoreHarness
from mos_lease.testing.oracle import Expected, ModelLease, Oracle
from mos_lease.testing.world import GRANT_TTLS, LEASE_TTLS, Minted, scope_sets
from mos_lease.vocabulary import LifecycleEvent, Outcome


class Waves:
    """Rules that run many calls at once (see the module)."""

    harness: StoreHarness
    oracle: Oracle
    gateways: list[ConnectorLeaseCoordinator]
    generations: list[int]
    handles: list[LeaseHandle]
    minted: list[Minted]
    audit_seen: int

    def _pick(self, data: st.DataObject, items: Sequence[Any]) -> Any:
        raise NotImplementedError  # the machine's

    def _audit_rows(self, after: int) -> Sequence[AuditRecord]:
        raise NotImplementedError  # the machine's

    def _dead(self, grant: ExecutionGrant) -> None:
        """``grant`` is of an epoch older than its lease's, and no longer usable."""
        snapshot = self.harness.store.load(grant.identity)
        row = snapshot.row
        assert row is not None and grant.epoch < row.epoch
        assert grant_refusal(row, snapshot.now, connector_id=grant.connector_id,
                             lease_id=grant.lease_id, epoch=grant.epoch,
                             granted_scopes=grant.scopes, grant_expires_at=grant.expires_at,
                             requested=()) is not None, "a grant of an older epoch is usable"

    def _expect_validation(self, minted: Minted, index: int, target: LeaseIdentity,
                           requested: frozenset[str]) -> Expected:
        grant = minted.grant
        return self.oracle.validate(
            recognized=index == minted.gateway
            and self.generations[index] == minted.generation,
            granted=grant.identity, target=target, connector_id=grant.connector_id,
            lease_id=grant.lease_id, epoch=grant.epoch,
            grant_scopes=frozenset(grant.scopes), grant_expires=minted.expires,
            requested=requested)

    def _together(self, calls: list[Callable[[], Any]], identity: LeaseIdentity,
                  rival: str | None, expected_epoch: int) -> tuple[list[Any], list[Any]]:
        """Run ``calls`` (and ``rival``'s takeover of ``identity``) on threads that start
        together; their results, and the takeover's."""
        count = len(calls)
        results: list[Any] = [None] * count
        taken: list[Any] = []
        start = threading.Barrier(count + (rival is not None))

        def call(k: int) -> None:
            start.wait()
            results[k] = calls[k]()

        def take() -> None:
            assert rival is not None
            start.wait()
            taken.append(self.gateways[0].takeover(
                identity, rival, scopes=["a"], ttl=LEASE_TTLS[0],
                expected_epoch=expected_epoch))

        workers = [threading.Thread(target=call, args=(k,)) for k in range(count)]
        if rival is not None:
            workers.append(threading.Thread(target=take))
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return results, taken

    def _wave(self, picks: list[tuple[Minted, int, frozenset[str]]],
              identity: LeaseIdentity, rival: str | None,
              expected_epoch: int) -> tuple[list[Any], list[Any]]:
        """Run the validations of ``picks`` (and ``rival``'s takeover) together."""
        def validation(minted: Minted, index: int,
                       requested: frozenset[str]) -> Callable[[], Any]:
            return lambda: self.gateways[index].validate(
                minted.grant, identity=minted.grant.identity, scopes=requested)

        return self._together([validation(*pick) for pick in picks], identity, rival,
                              expected_epoch)

    def _raced(self, identity: LeaseIdentity, rival: str | None, current: Any,
               taken: list[Any], audited: Counter[tuple[object, ...]]) -> bool:
        """Check ``rival``'s racing takeover of ``identity`` (if any) against the model,
        count its audit row, and record the new lease; whether it took the lease."""
        if rival is None:
            return False
        expected_epoch = current.epoch if current else 1
        racing = self.oracle.takeover(identity, rival, frozenset({"a"}), LEASE_TTLS[0],
                                      expected_epoch)
        result = taken[0]
        assert (result.outcome, result.reason) == (racing.outcome, racing.reason)
        audited[(racing.event, racing.outcome, racing.reason, identity, rival)] += 1
        if result.lease is None:
            return False
        assert current is not None and result.lease.epoch == current.epoch + 1
        self.oracle.leases[identity] = ModelLease(
            result.lease.epoch, result.lease.lease_id, rival, frozenset({"a"}),
            self.oracle.now + LEASE_TTLS[0])
        self.handles.append(result.lease)
        return True

    def _check_new_rows(self, audited: Counter[tuple[object, ...]]) -> None:
        new = self._audit_rows(self.audit_seen)
        if new:
            self.audit_seen = max(r.seq for r in new)
        assert Counter((r.entry.event, r.entry.outcome, r.entry.reason, r.entry.identity,
                        r.entry.connector_id) for r in new) == audited

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data(), count=st.integers(2, 6), rival=st.sampled_from(
        (None, "c3", "c1")), ttl=st.sampled_from(GRANT_TTLS))
    def issue_concurrently(self, data: st.DataObject, count: int, rival: str | None,
                           ttl: float) -> None:
        """Several grant issues across bindings at once (their reads and their audit
        rows, which a store may serve together: one statement, one commit), and with
        ``rival`` a takeover racing them: each issue is judged as if alone, before or
        after the takeover, with its own audit row; a grant minted under the epoch the
        takeover ended is never usable."""
        picks: list[tuple[LeaseHandle, int, frozenset[str]]] = [
            (self._pick(data, self.handles), data.draw(st.integers(0, 1)),
             data.draw(scope_sets)) for _ in range(count)]
        identity = picks[0][0].identity
        current = self.oracle.leases.get(identity)
        leases_before = {h.identity: self.oracle.leases[h.identity] for h, _i, _s in picks}

        def expect() -> list[Expected]:
            return [self.oracle.issue_grant(h.identity, h.connector_id, h.lease_id,
                                            h.epoch, scopes, ttl) for h, _i, scopes in picks]

        def issue(handle: LeaseHandle, index: int,
                  scopes: frozenset[str]) -> Callable[[], Any]:
            return lambda: self.gateways[index].issue_grant(handle, scopes=scopes, ttl=ttl)

        before = expect()
        results, taken = self._together([issue(*pick) for pick in picks], identity, rival,
                                        current.epoch if current else 1)
        audited: Counter[tuple[object, ...]] = Counter()
        took = self._raced(identity, rival, current, taken, audited)
        after = expect() if took else before
        for (handle, index, _scopes), got, was, now in zip(picks, results, before, after,
                                                            strict=True):
            # Judged against the store as it was before or after the takeover.
            assert (got.outcome, got.reason) in ((was.outcome, was.reason),
                                                 (now.outcome, now.reason)), (got, was, now)
            audited[(LifecycleEvent.GRANT_ISSUE, got.outcome, got.reason, handle.identity,
                     handle.connector_id)] += 1
            if got.grant is not None and took and handle.identity == identity:
                # Issued before the takeover or refused after it, as the race went: kept out
                # of the machine's state (what Hypothesis draws next must not depend on a
                # race) and checked here instead: minted under the epoch the takeover ended.
                self._dead(got.grant)
            elif got.grant is not None:
                # Issued only by the lease the handle names, which the takeover ended if
                # it took this identity: the grant's expiry is that lease's, at most.
                lease = leases_before[handle.identity]
                self.minted.append(Minted(got.grant, index, self.generations[index],
                                           min(self.oracle.now + ttl, lease.expires)))
        self._check_new_rows(audited)

    @precondition(lambda self: bool(self.minted))
    @rule(data=st.data(), count=st.integers(2, 6), rival=st.sampled_from(
        (None, "c3", "c1")))
    def validate_concurrently(self, data: st.DataObject, count: int,
                              rival: str | None) -> None:
        """Several validations across bindings at once (overlapping reads, which a store
        may serve together), and with ``rival`` a takeover racing them: each validation
        is judged as if alone, before or after the takeover, never both epochs valid."""
        # Mostly grants that validate now, each on the gateway that minted it: a read
        # answered with another binding's row would then show in the reason.
        live = [m for m in self.minted if self._expect_validation(
            m, m.gateway, m.grant.identity, frozenset()).reason is None]
        picks: list[tuple[Minted, int, frozenset[str]]] = []
        for _ in range(count):
            chance: int = data.draw(st.integers(0, 3))
            if live and chance:
                minted = self._pick(data, live)
                picks.append((minted, minted.gateway, frozenset[str]()))
            else:
                picks.append((self._pick(data, self.minted), data.draw(st.integers(0, 1)),
                              data.draw(scope_sets)))
        before = [self._expect_validation(m, i, m.grant.identity, r) for m, i, r in picks]
        identity: LeaseIdentity = picks[0][0].grant.identity
        current = self.oracle.leases.get(identity)
        results, taken = self._wave(picks, identity, rival, current.epoch if current else 1)
        after = before
        audited: Counter[tuple[object, ...]] = Counter()
        if self._raced(identity, rival, current, taken, audited):
            after = [self._expect_validation(m, i, m.grant.identity, r)
                     for m, i, r in picks]
        for (minted, index, _requested), got, was, now in zip(
                picks, results, before, after, strict=True):
            # Judged against the store as it was before or after the takeover.
            assert got.reason in (was.reason, now.reason), (got, was, now)
            if got.context is not None:
                lease = self.oracle.leases[minted.grant.identity]
                assert got.context.epoch == minted.grant.epoch
                assert (got.context.epoch == lease.epoch) == (got.reason is now.reason)
            if got.reason is not None:
                recognized = index == minted.gateway and self.generations[index] == (
                    minted.generation)
                audited[(LifecycleEvent.GRANT_VALIDATE, Outcome.DENIED, got.reason,
                         minted.grant.identity,
                         minted.grant.connector_id if recognized else "unrecognized")] += 1
        self._check_new_rows(audited)


__all__ = ["Waves"]
