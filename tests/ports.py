"""A TCP port for a server that a test starts later (a PostgreSQL node, etcd, Patroni, a
gateway process).

The usual trick, binding port 0 and closing the socket, hands out a port from the kernel's
ephemeral range, the very range every outgoing connection takes its local port from. On a
busy test machine (hundreds of client connections to the test database) a client can take
that port before the server binds it, and the server fails to start ("could not create any
TCP/IP sockets"). So the port is chosen below that range, where no client connection lands,
at random (several test processes may choose at once), never twice in one process, and
checked free by binding it.
"""

from __future__ import annotations

import random
import socket

_FLOOR = 10_000
_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default start; elsewhere the range is usually higher


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, outside the ephemeral range."""
    ceiling = _ephemeral_start()
    if ceiling - _FLOOR < 1_000:  # an unusual range: fall back to the kernel's choice
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            return port
    for _ in range(200):
        port = random.randrange(_FLOOR, ceiling)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port between {_FLOOR} and {ceiling} after 200 tries")
