"""Exceptions: misuse and infrastructure faults only.

Expected denials (a lease held by someone else, a stale epoch, ...) are never raised; they come
back as typed results carrying a :class:`~mos_lease.vocabulary.Reason`.
"""

from __future__ import annotations

from uuid import UUID


class MosLeaseError(Exception):
    """Base class of every exception the library raises on purpose."""


class InvalidInput(MosLeaseError, ValueError):
    """A caller passed a value the library refuses. Nothing was read or written.

    ``field`` names the offending argument so that callers can map it to their own API.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigurationError(MosLeaseError, ValueError):
    """A coordinator option or policy document is invalid (for example a cap raised above
    the library's hard limit)."""


class StoreUnavailable(MosLeaseError):
    """The store could not be reached or failed before the outcome of the operation was
    decided. Nothing was changed by this call."""


class CommitOutcomeUnknown(MosLeaseError):
    """A write was sent but its outcome could not be established, not even by rereading.

    The coordinator raises it only after trying to settle the outcome itself: a lease write
    (acquire, heartbeat, takeover, release) whose reply was lost is looked up and reread,
    and an audit row that changes no lease (a refusal's, a grant issue's) is sent once more;
    it is raised when that too could not reach the store. The write either fully happened
    (state change plus its audit row) or did not happen at all; ``event_id`` identifies its
    audit row, so a later :meth:`~mos_lease.ConnectorLeaseCoordinator.reconcile` can tell
    which (for a refusal it answers ``False``: the write it refused never happened).
    """

    def __init__(self, event_id: UUID, message: str) -> None:
        super().__init__(f"outcome of write {event_id} unknown: {message}")
        self.event_id = event_id


class GrantNotTransferable(MosLeaseError, TypeError):
    """Raised on any attempt to copy, deep-copy or pickle an execution grant: grants are
    capabilities that live only inside the coordinator instance that minted them."""


class InternalInconsistency(MosLeaseError):
    """The store and the pure decision core disagree; a bug in a store adapter."""


class MissingExtra(MosLeaseError, ImportError):
    """Raised by an adapter package at import when a dependency its extra installs is absent
    or unusable (``mos_lease_pg`` without psycopg); the message says what to install."""
