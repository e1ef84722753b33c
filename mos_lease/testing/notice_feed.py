"""A notice source driven by hand, for tests of a supervisor's ``notices=`` option: what
``mos_lease_pg.notices.LeaseNotices`` hands its subscribers, without a database."""

from __future__ import annotations

import threading
from collections.abc import Callable

from mos_lease.identity import LeaseIdentity
from mos_lease.notice_confirmer import NoticeConfirmer

AnyNoticeCallback = Callable[[LeaseIdentity, int, str], object]


class ManualNoticeFeed:
    """A :class:`~mos_lease.keep.notices.NoticeFeed`: :meth:`send` is one notice,
    true or forged, handed to every subscriber on the calling thread. ``confirmer`` is the
    notice confirmer its subscribers bound their confirming reads with (a new one with the
    default bound unless given)."""

    def __init__(self, confirmer: NoticeConfirmer | None = None) -> None:
        self.confirmer = confirmer if confirmer is not None else NoticeConfirmer()
        self._callbacks: list[AnyNoticeCallback] = []
        self._lock = threading.Lock()

    @property
    def subscribers(self) -> int:
        """How many callbacks are subscribed."""
        with self._lock:
            return len(self._callbacks)

    def subscribe_all(self, callback: AnyNoticeCallback) -> None:
        """Call ``callback(identity, epoch, kind)`` on every notice sent."""
        with self._lock:
            self._callbacks.append(callback)

    def unsubscribe_all(self, callback: AnyNoticeCallback) -> None:
        """Stop calling ``callback`` (nothing if it was not subscribed)."""
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def send(self, identity: LeaseIdentity, epoch: int, kind: str = "takeover") -> None:
        """One notice: ``identity``'s lease is at ``epoch`` (``"takeover"`` or
        ``"release"``), or so it says."""
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback(identity, epoch, kind)
