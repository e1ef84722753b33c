"""The rows the statements return, mapped to records: every time the core sees is in UTC,
whatever time zone the session delivered it in, and a read's one row maps column for
column."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest

from mos_lease import LeaseIdentity
from mos_lease.metadata import EMPTY_METADATA
from mos_lease_pg.rows import parse_renewals, parse_snapshot

pytestmark = pytest.mark.pg

IDENTITY = LeaseIdentity("tenant", "agent", "binding")
LEASE = uuid.UUID(int=7)
T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


def _read(zone: timezone, *, released: bool) -> tuple[object, ...]:
    """One row of load.sql: the database time, then the lease columns, in ``zone``."""
    def at(seconds: int) -> datetime:
        return (T0 + timedelta(seconds=seconds)).astimezone(zone)

    return (at(50), LEASE, "conn", ["tool:run"], 3, at(0), at(40), at(60),
            at(45) if released else None, at(45), None)


@pytest.mark.parametrize("released", [False, True])
@pytest.mark.parametrize("zone", [UTC, timezone(timedelta(hours=5, minutes=30)),
                                  timezone(timedelta(hours=-8))])
def test_a_read_maps_to_utc_times_in_any_session_time_zone(zone: timezone,
                                                            released: bool) -> None:
    snapshot = parse_snapshot(IDENTITY, [_read(zone, released=released)])
    row = snapshot.row
    assert row is not None
    times = [snapshot.now, row.acquired_at, row.heartbeat_at, row.expires_at,
             row.updated_at] + ([row.released_at] if released else [])
    assert all(t is not None and t.tzinfo is UTC for t in times)
    assert (snapshot.now, row.acquired_at, row.heartbeat_at, row.expires_at,
            row.updated_at) == (T0 + timedelta(seconds=50), T0, T0 + timedelta(seconds=40),
                                T0 + timedelta(seconds=60), T0 + timedelta(seconds=45))
    assert row.released_at == (T0 + timedelta(seconds=45) if released else None)
    assert (row.identity, row.lease_id, row.connector_id, row.scopes, row.epoch,
            row.metadata) == (IDENTITY, LEASE, "conn", ("tool:run",), 3, EMPTY_METADATA)


def test_a_read_that_found_no_row_maps_to_none() -> None:
    now = T0.astimezone(timezone(timedelta(hours=2)))
    snapshot = parse_snapshot(IDENTITY, [(now,) + (None,) * 10])
    assert snapshot.row is None and snapshot.now == T0 and snapshot.now.tzinfo is UTC


def test_a_read_of_other_than_one_row_is_a_bug_not_an_answer() -> None:
    with pytest.raises(AssertionError, match="exactly one row"):
        parse_snapshot(IDENTITY, [])


def test_a_batched_heartbeats_rows_map_in_order_and_reuse_the_lease_ids_sent() -> None:
    other = LeaseIdentity("tenant", "agent-2", "binding")
    sent = uuid.UUID(int=7)
    renewed = _read(timezone(timedelta(hours=-8)), released=False)
    refused = (renewed[0],) + (None,) * 10  # the LEFT JOIN found no renewed row
    outcomes = parse_renewals([(IDENTITY, sent), (other, uuid.UUID(int=8))],
                              [renewed, refused])
    first, second = outcomes
    assert first.row is not None and first.row.identity is IDENTITY
    assert first.row.lease_id is sent  # the object sent, not a copy per renewal
    assert first.now == T0 + timedelta(seconds=50) and first.now.tzinfo is UTC
    assert second.row is None and second.found is None and second.now == first.now
    # A row whose lease id differs from the one sent keeps its own (no borrowing by
    # position).
    [odd] = parse_renewals([(IDENTITY, uuid.UUID(int=9))], [renewed])
    assert odd.row is not None and odd.row.lease_id == LEASE
    with pytest.raises(AssertionError, match="expected 2 rows, got 1"):
        parse_renewals([(IDENTITY, sent), (other, sent)], [renewed])
