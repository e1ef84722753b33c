"""The forward to the holder: one HTTP/1.1 POST with the standard library's ``http.client``.

The recipes add no HTTP client dependency. The threaded gateway calls :func:`forward` on the
request's own thread; the asyncio gateway runs it in a worker thread
(``asyncio.to_thread``), so a slow holder never blocks the event loop. The body sent is the
one the screen rebuilt (``Work.forward_body``), never the caller's bytes, and the holder
screens it again.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import quote, urlsplit

import attrs

from examples.recipes.screen import HOPS_HEADER, MAX_BODY_BYTES, Refusal, Work


@attrs.frozen
class Relayed:
    """The holder's reply, relayed as it came: its status and its JSON body."""

    status: int
    body: bytes


def forward(endpoint: str, name: str, work: Work, hops: int, *,
            timeout: float) -> Relayed | Refusal:
    """POST ``work`` for binding ``name`` to ``endpoint`` carrying hop count ``hops``."""
    parts = urlsplit(endpoint)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.request("POST", f"/bindings/{quote(name, safe='')}/invoke",
                     body=work.forward_body(),
                     headers={"Content-Type": "application/json", HOPS_HEADER: str(hops)})
        reply = conn.getresponse()
        body = reply.read(MAX_BODY_BYTES + 1)
    except (OSError, http.client.HTTPException) as error:
        # A dead holder (refused, reset, timed out): its lease expires in at most a ttl and
        # a survivor takes the binding over; until then the caller retries.
        return Refusal(503, "holder_unreachable",
                       f"the holder at {endpoint} did not answer: {type(error).__name__}")
    finally:
        conn.close()
    try:
        json.loads(body)
    except ValueError:
        return Refusal(502, "bad_holder_reply", f"the holder at {endpoint} replied no JSON")
    return Relayed(reply.status, body)
