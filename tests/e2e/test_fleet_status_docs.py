"""The sample output of ``mos-lease status --fleet`` in ``docs/operations.md`` is what the
command prints for the fleet it describes: the rows below, judged and rendered by the
command's own code (``mos_lease.fleet.census``, ``mos_lease_pg.admin.render``). Run this
file as a script to print the sample again after a change of format."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from mos_lease import LeaseIdentity
from mos_lease.fleet.census import census
from mos_lease.fleet.members import member_identity, member_metadata
from mos_lease.metadata import Metadata
from mos_lease.records import LeaseRow
from mos_lease_pg.admin.render import fleet_text

PAGE = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
MARK = "<!-- sample: tests/e2e/test_fleet_status_docs.py -->"
NOW = datetime(2026, 3, 2, 9, 15, 0, tzinfo=UTC)


def _row(identity: LeaseIdentity, connector: str, expires: float, epoch: int = 1,
         metadata: Metadata | None = None) -> LeaseRow:
    at = NOW + timedelta(seconds=expires)
    return LeaseRow(identity, uuid.UUID(int=0), connector, (), epoch, at - timedelta(hours=1),
                    at - timedelta(seconds=10), at, None, at - timedelta(seconds=10),
                    metadata or Metadata({}))


def sample() -> str:
    """Three members of fleet ``edge`` over 3,000 bindings: ``gw-3`` stopped renewing (a
    crash), its member lease expired 1.75 s ago, and the others have taken over all but
    three of its bindings as they expired."""
    rows = [_row(member_identity("edge", name), name, expires, epoch,
                 member_metadata(f"{name}.internal:8443"))
            for name, expires, epoch in (("gw-1", 8.5, 1), ("gw-2", 9.25, 2), ("gw-3", -1.75, 1))]
    for n in range(3_000):
        identity = LeaseIdentity("acme", f"agent-{n:04}", "main")
        if n < 1_499:
            rows.append(_row(identity, "gw-1", 8.5, 2))
        elif n < 2_997:
            rows.append(_row(identity, "gw-2", 9.25, 2))
        else:  # gw-3's, expired and not taken over yet
            rows.append(_row(identity, "gw-3", -0.75 - (3_000 - n) / 4))
    return fleet_text(census("edge", NOW, rows, shown=3))


def _documented() -> str:
    text = PAGE.read_text(encoding="utf-8")
    found = re.search(re.escape(MARK) + r"\n```text\n(.*?)\n```", text, flags=re.DOTALL)
    assert found is not None, f"{PAGE} has no text block after {MARK}"
    return found.group(1)


def test_the_documented_sample_is_what_the_command_prints() -> None:
    assert _documented() == sample()


if __name__ == "__main__":
    print(sample())
