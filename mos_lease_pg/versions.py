"""The schema versions shipped in this package: ``sql/migrations/NNNN_name.sql``, numbered
1..n. A store checks at first use that its schema is at the newest of them
(:mod:`mos_lease_pg.preflight`); ``mos_lease_pg.admin.migrate`` applies them."""

from __future__ import annotations

import re
from importlib import resources

import attrs

from mos_lease.errors import MosLeaseError

_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class MigrationError(MosLeaseError):
    """The schema could not be brought up to date; nothing partial was committed for the
    version that failed."""


@attrs.frozen(slots=True)
class Migration:
    """One shipped migration: its ``version``, file ``name`` and ``sql``."""

    version: int
    name: str
    sql: str


def available_migrations() -> list[Migration]:
    """Every migration shipped with this package, in version order."""
    folder = resources.files("mos_lease_pg").joinpath("sql", "migrations")
    found = []
    for item in folder.iterdir():
        match = _NAME.match(item.name)
        if match:
            found.append(Migration(int(match[1]), match[2], item.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migration versions must run 1..n without gaps: {versions}")
    return found
