"""The entry point of the fault scenarios' worker processes.

Each worker is its own OS process (``python -m tests.faults.workers ROLE CONFIG.json``) with
its own PostgreSQL connection and its own coordinator, as separate gateway processes would
be. The roles live in :mod:`tests.faults.roles`, the gateway they drive in
:mod:`tests.faults.gateway`, and every call goes through :mod:`tests.faults.recorder`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.faults.gateway import SCOPES, Gateway
from tests.faults.recorder import Recorder
from tests.faults.roles import ROLES

# Code written when everything lived in this module imports these names from here.
__all__ = ["ROLES", "SCOPES", "Gateway", "Recorder", "main"]


@contextlib.contextmanager
def _quiet_library_logs() -> Iterator[None]:
    # Refusals are logged at INFO by the library; thousands of them would only fill the
    # worker's stderr file. Warnings still reach it.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    yield


def main(argv: list[str]) -> None:
    role, config_path = argv[1], argv[2]
    cfg = json.loads(Path(config_path).read_text("utf-8"))
    with _quiet_library_logs():
        ROLES[role](cfg)


if __name__ == "__main__":
    main(sys.argv)
