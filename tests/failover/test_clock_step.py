"""A failover to a host whose clock differs: database time steps by the difference.

(The last test here: a step back of 30 s, and what the schema and the store make of it.)

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
from datetime import timedelta

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity, Outcome, Reason
from mos_lease.keeper import KeeperTiming
from mos_lease.vocabulary import LeaseState
from mos_lease_pg.admin.check import Status, run_check
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
@pytest.mark.parametrize("test", [
    "test_keeper_default_margin_covers_a_clock_step_at_failover[ahead]",
    "test_a_failover_to_a_host_30_s_behind_refuses_every_write_before_the_rows_stamps"])
def test_without_libfaketime_it_skips_naming_the_package_or_fails_when_required(
        test: str, require: bool) -> None:
    output = tools.run_without_tools(f"tests/failover/test_clock_step.py::{test}",
                                     require=require)
    assert "libfaketime not installed (Debian: apt-get install libfaketime)" in output, output
    if require:
        assert "1 error" in output and "MOS_LEASE_REQUIRE_TOOLS is set" in output, output
    else:
        assert "1 skipped" in output and "error" not in output, output


BACK = 30.0  # a step back far larger than a keeper's margin, as a badly set host makes


def test_a_failover_to_a_host_30_s_behind_refuses_every_write_before_the_rows_stamps(
        shiftable_pair: ReplicatedPair, capsys: pytest.CaptureFixture[str]) -> None:
    """The standby's clock is 30 s behind the primary's. A lease a rival saw expire on the
    old primary, and a lease renewed just before the failover: on the new primary every
    write to either is refused ``clock_behind`` (audited) instead of being judged at a time
    before what was already written and seen, and ``mos-lease check`` reports the step."""
    pair = shiftable_pair
    dsn = migrated(pair)
    pair.shift_standby_clock(f"-{BACK:g}s")
    measured = clock_offset(pair.standby) - clock_offset(pair.primary)
    assert abs(measured + BACK) < 0.5, f"the standby's clock is off by {measured:.2f} s"

    seen_expired = LeaseIdentity("t-back", "agent", "seen-expired")
    renewed = LeaseIdentity("t-back", "agent", "renewed")
    with store(dsn) as old_store:
        gateway = ConnectorLeaseCoordinator(old_store, no_preempt_policy())
        short = gateway.acquire(seen_expired, "c1", scopes=SCOPES, ttl=1)
        live = gateway.acquire(renewed, "c1", scopes=SCOPES, ttl=TTL)
        assert short.lease is not None and live.lease is not None
        time.sleep(1.2)
        # A rival sees the short lease expired (and would act on it: takeovers are allowed).
        view = ConnectorLeaseCoordinator(old_store, no_preempt_policy()).current_holder(
            seen_expired)
        assert view is not None and view.state is LeaseState.EXPIRED
        beat = gateway.heartbeat(live.lease, ttl=TTL)
        assert beat.lease is not None
    pair.fail_over()

    with store(dsn, require_synchronous_replication=False) as new_store:
        gateway = ConnectorLeaseCoordinator(new_store, no_preempt_policy())
        results = {
            "heartbeat of the lease seen expired": gateway.heartbeat(short.lease, ttl=TTL),
            "release of the lease seen expired": gateway.release(short.lease),
            # At the earlier time the lease looks active again: a rival that may preempt.
            "takeover of the lease seen expired": ConnectorLeaseCoordinator(
                new_store, AllowAllPolicy()).takeover(
                    seen_expired, "c2", scopes=SCOPES, ttl=TTL, expected_epoch=1),
            "heartbeat of the renewed lease": gateway.heartbeat(beat.lease, ttl=TTL),
            "batched heartbeat of the renewed lease": gateway.heartbeat_many(
                [beat.lease], ttl=TTL)[0],
            "release of the renewed lease": gateway.release(beat.lease),
        }
        reasons = {name: result.reason for name, result in results.items()}
        audited = [r.entry.reason for ident in (seen_expired, renewed)
                   for r in new_store.audit(ident) if r.entry.outcome is Outcome.DENIED]
        rows = {ident: new_store.load(ident).row for ident in (seen_expired, renewed)}
    with capsys.disabled():
        print(f"\nclock step {-BACK:+g} s at failover (measured {measured:+.2f} s): "
              f"{sum(r is Reason.CLOCK_BEHIND for r in reasons.values())} of {len(reasons)} "
              f"writes refused clock_behind, {len(audited)} audited; reasons {reasons}")
    assert reasons == dict.fromkeys(results, Reason.CLOCK_BEHIND), reasons
    assert audited == [Reason.CLOCK_BEHIND] * len(results)
    # Nothing was written: the rows keep the old primary's stamps and epochs.
    assert {ident: (row.epoch, row.updated_at) for ident, row in rows.items()
            if row is not None} == {seen_expired: (1, short.lease.expires_at - timedelta(
                seconds=1)), renewed: (1, beat.lease.expires_at - timedelta(seconds=TTL))}
    report, code = run_check(dsn)
    [steps] = [i for i in report.items if i.name == "clock_steps"]
    with capsys.disabled():
        print(f"check: {steps.status.value} {steps.value}")
    assert steps.status is Status.PROBLEM and code == 1
