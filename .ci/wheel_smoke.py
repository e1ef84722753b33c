"""The installed wheel on its own: run from a directory outside the source tree with the
Python of a clean environment where only the wheel (with its ``testing`` extra) is
installed. Checks that the package comes from that environment, that its version is the
expected one, and runs the conformance kit's store contract against the in-memory store,
and against a store that breaks the contract (which the kit must catch).

Usage: python wheel_smoke.py EXPECTED_VERSION
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from uuid import UUID

import mos_lease
from mos_lease.testing import run_store_contract
from mos_lease_memory import InMemoryLeaseStore, MemoryHarness


class ClaimsEveryEvent(MemoryHarness):
    """A store that reports every event id as committed, refused writes included."""

    def __init__(self) -> None:
        super().__init__()

        class Store(InMemoryLeaseStore):
            def event_committed(self, event_id: UUID) -> bool:
                return True

        self._store = Store(self.clock)


def main(expected_version: str) -> None:
    package = Path(mos_lease.__file__).resolve()
    environment = Path(sys.prefix).resolve()
    assert package.is_relative_to(environment), f"{package} is not installed in {environment}"
    assert mos_lease.__version__ == expected_version, (mos_lease.__version__, expected_version)
    shown = subprocess.run([str(Path(sys.executable).parent / "mos-lease"), "--version"],
                           capture_output=True, text=True, check=True, timeout=60).stdout
    assert shown.strip() == f"mos-lease {expected_version}", shown

    run_store_contract(MemoryHarness, steps=300)
    try:
        run_store_contract(ClaimsEveryEvent, steps=300)
    except AssertionError as caught:
        # Whichever case meets the lie first names it: a refusal, or a refused item of a
        # batch, whose event id the store claims took effect.
        assert any(said in str(caught) for said in (
            "reconciles as committed", "audit row presence does not match")), caught
    else:
        raise AssertionError("the store contract passed a store that breaks it")
    print(f"mos-lease {mos_lease.__version__} from {package.parent}: the store contract "
          "passes on the in-memory store and catches a broken one")


if __name__ == "__main__":
    main(*sys.argv[1:])
