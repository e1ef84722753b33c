"""One gateway of the fault scenarios: a PostgreSQL store on its own connection, a
coordinator and a recorder (:class:`Gateway`), and the small protocol a worker process
speaks with the harness (``READY``, ``GO``, a stop file)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    ConnectorLeaseService,
    ExecutionGrant,
    GrantResult,
    LeaseHandle,
    LeaseIdentity,
    LeaseResult,
    StaticConnectorPolicy,
    ValidationResult,
)
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from tests.faults import clockskew
from tests.faults.history import Op, OpRecord
from tests.faults.recorder import Recorder

SCOPES = ("tool:read", "tool:run")
Config = Mapping[str, Any]


def no_preempt_policy() -> ConnectorLeaseService:
    """Everything allowed except preempting an active lease: takeovers only follow expiry
    or release, so decisions depend on time alone (scenario 7's oracle needs that)."""
    return StaticConnectorPolicy.from_dict({"rules": [{
        "tenant_id": "*", "logical_agent_id": "*", "binding_id": "*", "connector_id": "*",
        "scopes": list(SCOPES), "max_lease_ttl": 300, "max_grant_ttl": 30,
        "preempt_active": False}]})


def _seconds(cfg: Config, key: str, default: timedelta | None) -> timedelta | None:
    return timedelta(seconds=float(cfg[key])) if key in cfg else default


class Gateway:
    """One gateway: a store on its own connection, a coordinator, a recorder."""

    def __init__(self, cfg: Config, store: PostgresLeaseStore | None = None) -> None:
        """``store`` replaces the dedicated-connection store built from ``cfg["dsn"]`` (for
        a pooled store)."""
        self.cfg = cfg
        self.process = str(cfg["process"])
        self.connector = str(cfg.get("connector", self.process))
        defaults = ConnectionSettings()
        settings = ConnectionSettings(
            statement_timeout=_seconds(cfg, "statement_timeout", defaults.statement_timeout),
            lock_timeout=_seconds(cfg, "lock_timeout", defaults.lock_timeout),
            connect_timeout=float(cfg.get("connect_timeout", 2)),
            application_name=f"faults-{self.process}"[:60])
        self.store = store if store is not None else PostgresLeaseStore(str(cfg["dsn"]),
                                                                        settings=settings)
        policy = no_preempt_policy() if cfg.get("policy") == "no_preempt" else AllowAllPolicy()
        self.coordinator = ConnectorLeaseCoordinator(self.store, policy)
        self.rec = Recorder(Path(cfg["records"]), self.process,
                            str(cfg.get("clock_dsn", cfg["dsn"])),
                            durable=bool(cfg.get("durable", False)))
        self._seq = 0
        self.deadline = clockskew.real_monotonic() + float(cfg.get("max_seconds", 60))

    def corr(self, tag: str) -> str:
        self._seq += 1
        return f"{self.process}-{tag}{self._seq}"

    def out_of_time(self) -> bool:
        return clockskew.real_monotonic() >= self.deadline

    # Each wrapper records one lifecycle call.

    def acquire(self, identity: LeaseIdentity, ttl: float) -> LeaseResult | None:
        corr = self.corr("a")
        result, _ = self.rec.call(Op.ACQUIRE, identity, self.connector, corr, lambda: (
            self.coordinator.acquire(identity, self.connector, scopes=SCOPES, ttl=ttl,
                                     correlation_id=corr)))
        return result

    def takeover(self, identity: LeaseIdentity, ttl: float,
                 expected_epoch: int) -> LeaseResult | None:
        corr = self.corr("t")
        result, _ = self.rec.call(Op.TAKEOVER, identity, self.connector, corr, lambda: (
            self.coordinator.takeover(identity, self.connector, scopes=SCOPES, ttl=ttl,
                                      expected_epoch=expected_epoch, correlation_id=corr)),
            presented_epoch=expected_epoch, args={"expected_epoch": expected_epoch})
        return result

    def heartbeat(self, lease: LeaseHandle, ttl: float) -> LeaseResult | None:
        corr = self.corr("h")
        result, _ = self.rec.call(Op.HEARTBEAT, lease.identity, lease.connector_id, corr,
                                  lambda: self.coordinator.heartbeat(lease, ttl=ttl,
                                                                     correlation_id=corr),
                                  presented_epoch=lease.epoch,
                                  args={"lease_id": str(lease.lease_id)})
        return result

    def release(self, lease: LeaseHandle) -> LeaseResult | None:
        corr = self.corr("r")
        result, _ = self.rec.call(Op.RELEASE, lease.identity, lease.connector_id, corr,
                                  lambda: self.coordinator.release(lease, correlation_id=corr),
                                  presented_epoch=lease.epoch,
                                  args={"lease_id": str(lease.lease_id)})
        return result

    def issue_grant(self, lease: LeaseHandle, ttl: float) -> GrantResult | None:
        corr = self.corr("g")
        result, _ = self.rec.call(Op.ISSUE_GRANT, lease.identity, lease.connector_id, corr,
                                  lambda: self.coordinator.issue_grant(
                                      lease, scopes=SCOPES, ttl=ttl, correlation_id=corr),
                                  presented_epoch=lease.epoch,
                                  args={"lease_id": str(lease.lease_id)})
        return result

    def validate(self, grant: ExecutionGrant, identity: LeaseIdentity | None = None,
                 scopes: tuple[str, ...] = SCOPES, tag: str = "v") -> ValidationResult | None:
        """Validate ``grant`` (genuine or not: its fields are read only for the record).
        ``tag`` marks the correlation id (``replay`` for grants rebuilt from elsewhere)."""
        target = identity if identity is not None else grant.identity
        corr = self.corr(tag)
        result, _ = self.rec.call(
            Op.VALIDATE, target, grant.connector_id, corr,
            lambda: self.coordinator.validate(grant, identity=target, scopes=scopes,
                                              correlation_id=corr),
            audit_key=grant.correlation_id, presented_epoch=grant.epoch,
            args={"grant_id": str(grant.grant_id), "lease_id": str(grant.lease_id)})
        return result

    def heartbeat_many(self, leases: list[LeaseHandle], ttl: float) -> list[OpRecord]:
        corr = self.corr("hm")
        items = [(lease.identity, lease.connector_id, lease.epoch,
                  {"lease_id": str(lease.lease_id)}) for lease in leases]
        return self.rec.call_batch(Op.HEARTBEAT, items, corr, lambda: (
            self.coordinator.heartbeat_many(leases, ttl=ttl, correlation_id=corr)))

    def close(self) -> None:
        self.store.close()
        self.rec.close()

    def summary(self, **extra: Any) -> None:
        out = {"process": self.process, "ops": len(self.rec.records),
               "tally": self.rec.tally(), "crashes": self.rec.crashes[:20], **extra}
        print("SUMMARY " + json.dumps(out, default=str), flush=True)


def say(word: str) -> None:
    print(word, flush=True)


def wait_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "GO":
        raise SystemExit(f"expected GO, got {line!r}")


def identities(cfg: Config, key: str = "bindings") -> list[LeaseIdentity]:
    return [LeaseIdentity(str(cfg["tenant"]), str(cfg.get("agent", "agent")), str(b))
            for b in cfg[key]]


def stop_requested(cfg: Config) -> bool:
    path = cfg.get("stop_file")
    return path is not None and os.path.exists(str(path))
