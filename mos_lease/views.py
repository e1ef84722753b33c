"""The holder views a coordinator handed out, so a takeover may act on one without a read.

A takeover tells the policy the lease's state and holder. A caller may pass the
:class:`~mos_lease.results.HolderView` the same coordinator just returned for that identity
(``current_holder()``, or a refused acquire's ``LeaseResult.holder``) instead of having the
takeover read it again. Only the very view object it returned is accepted, for the identity
it was read for: a view built or altered by hand could tell the policy a different holder.
Entries go with the views (weak references), so nothing grows with the number of calls.
"""

from __future__ import annotations

import weakref

from mos_lease.errors import InvalidInput
from mos_lease.identity import LeaseIdentity
from mos_lease.results import HolderView


class ViewRegistry:
    def __init__(self) -> None:
        self._issued: dict[int, tuple[weakref.ref[HolderView], LeaseIdentity]] = {}

    def __len__(self) -> int:
        return len(self._issued)

    def issue(self, view: HolderView, identity: LeaseIdentity) -> HolderView:
        key = id(view)

        def forget(_gone: weakref.ref[HolderView], issued: dict[int, tuple[
                weakref.ref[HolderView], LeaseIdentity]] = self._issued) -> None:
            # Only if the entry is still this one: the id may already name a newer view.
            entry = issued.get(key)
            if entry is not None and entry[0] is _gone:
                issued.pop(key, None)

        self._issued[key] = (weakref.ref(view, forget), identity)
        return view

    def check(self, observed: object, identity: LeaseIdentity,
              expected_epoch: int) -> HolderView | None:
        """``observed`` if it is a view this registry issued for ``identity`` at
        ``expected_epoch``; ``None`` if it is ``None``; else :class:`InvalidInput`."""
        if observed is None:
            return None
        if not isinstance(observed, HolderView):
            raise InvalidInput("observed", f"must be a HolderView, not {type(observed).__name__}")
        entry = self._issued.get(id(observed))
        if entry is None or entry[0]() is not observed or entry[1] != identity:
            raise InvalidInput("observed", "must be a HolderView this coordinator returned for "
                               "this identity (current_holder() or a denied result's holder)")
        if observed.epoch != expected_epoch:
            raise InvalidInput("observed", f"shows epoch {observed.epoch}, not expected_epoch "
                               f"{expected_epoch}")
        return observed
