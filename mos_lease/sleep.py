"""The one pause step: a generator of steps that wants time to pass yields :class:`Sleep`.

Whoever drives the steps decides how to wait (``time.sleep``, ``asyncio.sleep``, an event
that a notice may set early, a fake clock in tests); the steps only say how long. The
supervisor engine's turn pauses this way, for every binding it runs.
"""

from __future__ import annotations

import attrs


@attrs.frozen(slots=True)
class Sleep:
    """Wait ``seconds`` (a driver may end the wait early, say when it is stopped); the
    step is resumed with ``None``."""

    seconds: float
