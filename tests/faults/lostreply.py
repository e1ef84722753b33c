"""A loopback proxy that loses a write's reply after the write committed.

Killing a backend almost never produces "committed, but the reply was lost": the kill lands
before the commit far more often than in the microseconds between the commit and the reply.
This proxy makes that case on demand. Armed with a marker (a piece of one statement's text,
so the store under test sends statement text with every execution:
``ConnectionSettings(prepare=False)``), it forwards the next request that contains the
marker to the server, then withholds everything the server answers on that connection until
the server's ``ReadyForQuery``. PostgreSQL sends ``ReadyForQuery`` only once the statement's
implicit transaction has ended, so by then the write has committed (or failed on its own);
the proxy discards the whole reply and closes both sides. The client sees its connection end
with no reply at all.

``times`` strikes that many matching requests in a row (a store that sends an audit append
once more on a fresh connection is struck again); ``then_refuse`` closes every connection
opened after the last strike as soon as it opens, until :meth:`heal`, so that nothing the
caller tries afterwards reaches the server.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from psycopg.conninfo import make_conninfo

from tests.pg_support import PairedRelay

_READY_FOR_QUERY = ord("Z")


class _Pair:
    """One relayed connection: its two sockets, and whether its reply is being withheld."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.withholding = threading.Event()


class ReplyLossProxy(PairedRelay[_Pair]):
    """See the module's docstring. :attr:`strikes` counts replies lost after their commit;
    :attr:`struck_at` is ``time.monotonic()`` of the last one."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self._dsn = dsn
        self._marker: bytes | None = None
        self._left = 0
        self._then_refuse = False
        self._refusing_now = False
        self.strikes = 0
        self.struck_at: float | None = None
        self._start()

    @property
    def dsn(self) -> str:
        # No TLS or GSS negotiation, so every byte the server sends is a protocol message.
        return make_conninfo(self._dsn, host="127.0.0.1", port=str(self.port),
                             sslmode="disable", gssencmode="disable")

    def arm(self, marker: bytes, *, times: int = 1, then_refuse: bool = False) -> None:
        """Lose the reply of the next ``times`` requests containing ``marker``, each once
        the server has finished the statement (committed it)."""
        with self._lock:
            self._marker, self._left, self._then_refuse = marker, times, then_refuse
            self.strikes, self.struck_at = 0, None

    def heal(self) -> None:
        """From now on every request and reply is relayed."""
        with self._lock:
            self._marker, self._left, self._refusing_now = None, 0, False

    def _pair(self, client: socket.socket, upstream: socket.socket) -> _Pair:
        return _Pair(client, upstream)

    def _refusing(self) -> bool:
        return self._refusing_now

    def _matches(self, data: bytes) -> bool:
        with self._lock:
            if self._marker is None or self._left == 0 or self._marker not in data:
                return False
            self._left -= 1
            return True

    def _requests(self, pair: _Pair) -> None:
        with contextlib.suppress(OSError):
            while data := pair.client.recv(65536):
                if self._matches(data):
                    # Set before the request leaves: every byte of its reply is withheld.
                    pair.withholding.set()
                pair.upstream.sendall(data)
        self._hang_up(pair.client, pair.upstream)

    def _replies(self, pair: _Pair) -> None:
        held = b""
        with contextlib.suppress(OSError):
            while data := pair.upstream.recv(65536):
                if not pair.withholding.is_set():
                    pair.client.sendall(data)
                    continue
                # The client sent nothing since its last ReadyForQuery, so the reply starts
                # on a message boundary: read whole messages (type byte, then a length that
                # counts itself) until the one that says the transaction is over.
                held += data
                if _ready_for_query_in(held):
                    self._strike()
                    break
        self._hang_up(pair.client, pair.upstream)

    def _strike(self) -> None:
        with self._lock:
            self.strikes += 1
            self.struck_at = time.monotonic()
            if self._left == 0 and self._then_refuse:
                self._refusing_now = True


def _ready_for_query_in(held: bytes) -> bool:
    """Whether the complete messages at the start of ``held`` include a ReadyForQuery."""
    at = 0
    while len(held) - at >= 5:
        length = int.from_bytes(held[at + 1:at + 5], "big")
        if len(held) - at < 1 + length:
            return False
        if held[at] == _READY_FOR_QUERY:
            return True
        at += 1 + length
    return False
