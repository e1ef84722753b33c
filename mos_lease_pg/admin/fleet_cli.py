"""``mos-lease status --fleet NAME``: a fleet's members, their shares and the bindings no one
holds, from one read of the lease table (:meth:`~mos_lease_pg.PostgresLeaseStore.
fleet_leases`), judged by :func:`mos_lease.fleet.census.census` and printed by
:mod:`mos_lease_pg.admin.render`. The options are added to ``status`` (``register``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from mos_lease.errors import InvalidInput, MosLeaseError
from mos_lease.fleet.census import MAX_UNHELD_SHOWN, UNHELD_SHOWN, census
from mos_lease.fleet.members import FLEET_TENANT
from mos_lease.identity import check_id
from mos_lease_pg.admin import render
from mos_lease_pg.store import PostgresLeaseStore


def _fleet_name(value: str) -> str:
    try:
        return check_id("fleet", value)
    except InvalidInput as bad:
        raise argparse.ArgumentTypeError(f"fleet name {value!r}: {bad.message}") from None


def _shown(value: str) -> int:
    try:
        shown = int(value)
    except ValueError:
        shown = -1
    if not 0 <= shown <= MAX_UNHELD_SHOWN:
        raise argparse.ArgumentTypeError(f"{value!r}: must be a whole number from 0 to "
                                         f"{MAX_UNHELD_SHOWN}")
    return shown


def register(status: argparse.ArgumentParser) -> None:
    """Add ``--fleet`` and ``--show`` to the ``status`` command's parser."""
    status.add_argument("--fleet", type=_fleet_name, metavar="NAME",
                        help="show fleet NAME: its members, their shares and the bindings "
                             "no one holds")
    status.add_argument("--show", type=_shown, default=UNHELD_SHOWN, metavar="N",
                        help="with --fleet: list at most N bindings without a holder, the "
                             f"oldest first (default {UNHELD_SHOWN}, at most "
                             f"{MAX_UNHELD_SHOWN})")


def run(args: argparse.Namespace, open_store: Callable[[], PostgresLeaseStore]) -> int:
    """Read and print fleet ``args.fleet`` through a store ``open_store()`` opens (and this
    closes). Exit 1 if the
    store cannot be read, or if no member of the fleet ever held its member lease (a name
    mistyped, most likely: the message says where the members' leases would be)."""
    try:
        with open_store() as store:
            now, rows = store.fleet_leases(args.fleet, args.tenant)
    except MosLeaseError as error:
        print(f"mos-lease: {error}", file=sys.stderr)
        return 1
    found = census(args.fleet, now, rows, args.show)
    if not found.members:
        print(f"mos-lease: no member of fleet {args.fleet!r} has ever held its member lease "
              f"in schema {args.schema} (members hold tenant {FLEET_TENANT!r}, logical "
              f"agent {args.fleet!r})", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(render.fleet_json(found), indent=2))
    else:
        print(render.fleet_text(found))
    return 0
