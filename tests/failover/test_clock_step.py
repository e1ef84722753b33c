"""A failover to a host whose clock differs: database time steps by the difference.

The standby runs under libfaketime (``FAKETIME=+2s`` / ``-2s``), so once promoted, every
expiry written by the old primary is judged on a clock 2 s ahead of (or behind) the one that
wrote it. Ahead, a lease ends 2 s early in host time: a rival takes it over while its holder
still counts on it, unless the holder's keeper stops at least that much before the expiry it
was told. Behind, it ends 2 s late: safe for fencing, only slower to take over.

Without libfaketime (Debian ``libfaketime``) the test skips, or fails where
``MOS_LEASE_REQUIRE_TOOLS=1`` (``tests/tools.py``).

The check is the keeper's default: a holder that acquired with ``ttl`` stops acting at
``KeeperTiming(ttl).deadline(start)``; a rival on the new primary must not win before that.
"""

from __future__ import annotations

import time

import pytest

from mos_lease import ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.keeper import KeeperTiming
from tests import tools
from tests.failover.cluster import Node, ReplicatedPair
from tests.failover.support import migrated, store
from tests.faults.gateway import SCOPES, no_preempt_policy

TTL = 10.0
# A deployment's bound on the clock difference between its database hosts (NTP keeps
# well-run hosts within milliseconds; a step of this size is what this test makes).
STEP = 2.0


@pytest.fixture
def shiftable_pair(request: pytest.FixtureRequest) -> ReplicatedPair:
    """The pair, once libfaketime is known to be there (checked before the pair is built)."""
    tools.need(tools.LIBFAKETIME)
    made: ReplicatedPair = request.getfixturevalue("pair")
    return made


def clock_offset(node: Node) -> float:
    """The node's ``clock_timestamp()`` minus the host's clock, in seconds (the midpoint of
    the round trip)."""
    with node.connect() as conn:
        before = time.time()
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        after = time.time()
    assert row is not None
    return float(row[0]) - (before + after) / 2


@pytest.mark.parametrize("offset", [STEP, -STEP], ids=["ahead", "behind"])
def test_keeper_default_margin_covers_a_clock_step_at_failover(
        shiftable_pair: ReplicatedPair, offset: float,
        capsys: pytest.CaptureFixture[str]) -> None:
    pair = shiftable_pair
    dsn = migrated(pair)
    pair.shift_standby_clock(f"{offset:+g}s")
    measured = clock_offset(pair.standby) - clock_offset(pair.primary)
    assert abs(measured - offset) < 0.5, f"the standby's clock is off by {measured:.2f} s"

    identity = LeaseIdentity("t-clock", "agent", "b")
    with store(dsn) as holder_store:
        holder = ConnectorLeaseCoordinator(holder_store, no_preempt_policy())
        started = time.monotonic()
        acquired = holder.acquire(identity, "c1", scopes=SCOPES, ttl=TTL)
    assert acquired.ok and acquired.lease is not None
    # What the holder's keeper would go by: its last success's start, plus ttl - margin.
    stops_at = KeeperTiming(ttl=TTL).deadline(started)
    pair.fail_over()

    attempts = 0
    # The new primary runs alone until a standby is rebuilt (seconds of its own): the rival
    # does not wait for one, the clock is what is tested here.
    with store(dsn, require_synchronous_replication=False) as rival_store:
        rival = ConnectorLeaseCoordinator(rival_store, no_preempt_policy())
        while True:
            attempts += 1
            taken = rival.takeover(identity, "c2", scopes=SCOPES, ttl=TTL, expected_epoch=1)
            if taken.ok:
                won = time.monotonic()
                break
            assert time.monotonic() < started + TTL + abs(offset) + 10, taken.reason
            time.sleep(0.02)
    with capsys.disabled():
        print(f"\nclock step {offset:+g} s at failover (measured {measured:+.2f} s): lease "
              f"acquired with ttl {TTL:g} s; rival took over {won - started:.2f} s after "
              f"the acquire began (the holder's default keeper stops at "
              f"{stops_at - started:.2f} s, margin {KeeperTiming(ttl=TTL).margin:g} s); "
              f"{attempts} attempts")
    # Never before the holder stopped: two holders acting at once is what fencing forbids.
    assert won >= stops_at, (
        f"a rival won {stops_at - won:.2f} s before the holder's keeper stopped: the default "
        f"safety margin ({KeeperTiming(ttl=TTL).margin:g} s at ttl {TTL:g} s) does not cover "
        f"a {offset:+g} s step of database time")


@pytest.mark.parametrize("require", [False, True])
def test_without_libfaketime_it_skips_naming_the_package_or_fails_when_required(
        require: bool) -> None:
    output = tools.run_without_tools(
        "tests/failover/test_clock_step.py::"
        "test_keeper_default_margin_covers_a_clock_step_at_failover[ahead]", require=require)
    assert "libfaketime not installed (Debian: apt-get install libfaketime)" in output, output
    if require:
        assert "1 error" in output and "MOS_LEASE_REQUIRE_TOOLS is set" in output, output
    else:
        assert "1 skipped" in output and "error" not in output, output
