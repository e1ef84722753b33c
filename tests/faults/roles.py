"""The roles a fault worker process plays, one function each, named in :data:`ROLES`:
``race`` (scenario 1), ``storm`` (2), ``holder`` (3), ``victim`` (4), ``load`` (6),
``skew`` (7) and ``smuggle`` (10)."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime

from mos_lease import ExecutionGrant, LeaseHandle, LeaseIdentity, MosLeaseError, StoreUnavailable
from tests.faults import clockskew
from tests.faults.gateway import Config, Gateway, identities, say, stop_requested, wait_go
from tests.faults.history import Status
from tests.faults.replicas import grant_fields, read_dump, replica


def role_race(cfg: Config) -> None:
    """Scenario 1: acquire every identity, in the same order as every other racer."""
    gw = Gateway(cfg)
    idents = identities(cfg)
    gw.rec.clock().now()  # connect the clock before the start line
    say("READY")
    wait_go()
    wins = 0
    for identity in idents:
        result = gw.acquire(identity, ttl=60)
        wins += bool(result is not None and result.ok)
    gw.summary(wins=wins)
    gw.close()


def role_storm(cfg: Config) -> None:
    """Scenario 2: take over shared identities round after round (preemption allowed), mint a
    grant after every win, and keep validating the last few grants from a second thread."""
    gw = Gateway(cfg)
    idents = identities(cfg)
    rounds = int(cfg["rounds"])
    keep: deque[ExecutionGrant] = deque(maxlen=int(cfg.get("keep", 3)))
    lock = threading.Lock()
    stop = threading.Event()
    index = int(cfg.get("index", 0))

    def validator() -> None:
        # Validates old and new grants alike: every grant of an epoch that was taken over
        # since must be refused.
        while not stop.is_set() and not gw.out_of_time():
            with lock:
                grants = list(keep)
            if not grants:
                time.sleep(0.001)
                continue
            for grant in grants:
                gw.validate(grant)

    gw.rec.clock().now()
    say("READY")
    wait_go()
    threads = [threading.Thread(target=validator, daemon=True)
               for _ in range(int(cfg.get("validators", 1)))]
    for thread in threads:
        thread.start()
    won = 0
    done = 0
    for r in range(rounds):
        if gw.out_of_time():
            break
        identity = idents[(r + index) % len(idents)]
        try:
            snapshot = gw.store.load(identity)
        except StoreUnavailable:
            continue
        if snapshot.row is None:
            continue
        done += 1
        result = gw.takeover(identity, ttl=30, expected_epoch=snapshot.row.epoch)
        if result is None or not result.ok or result.lease is None:
            continue
        won += 1
        granted = gw.issue_grant(result.lease, ttl=30)
        if granted is not None and granted.grant is not None:
            with lock:
                keep.append(granted.grant)
            gw.validate(granted.grant)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    gw.summary(rounds=done, won=won)
    gw.close()


def role_holder(cfg: Config) -> None:
    """Scenario 3: hold a lease and keep using it (heartbeat, grant, validate) until told to
    stop; the harness freezes this process with SIGSTOP in between."""
    gw = Gateway(cfg)
    (identity,) = identities(cfg)
    ttl = float(cfg["ttl"])
    acquired = gw.acquire(identity, ttl=ttl)
    if acquired is None or acquired.lease is None:
        gw.summary(error="could not acquire")
        gw.close()
        return
    lease = acquired.lease
    kept: deque[ExecutionGrant] = deque(maxlen=4)
    say("READY")
    while not stop_requested(cfg) and not gw.out_of_time():
        beat = gw.heartbeat(lease, ttl=ttl)
        if beat is not None and beat.ok and beat.lease is not None:
            lease = beat.lease  # same lease id and epoch, later expiry
        granted = gw.issue_grant(lease, ttl=min(ttl, 30.0))
        if granted is not None and granted.grant is not None:
            kept.append(granted.grant)
        for grant in list(kept):
            gw.validate(grant)
        time.sleep(0.005)
    gw.summary()
    gw.close()



def _take_when_expired(gw: Gateway, identity: LeaseIdentity, ttl: float,
                       patience: float) -> tuple[LeaseHandle | None, float]:
    """Acquire, or take over once the current lease is over by database time. Returns the
    lease (``None`` if stuck) and the seconds it took."""
    began = clockskew.real_monotonic()
    while clockskew.real_monotonic() - began < patience:
        try:
            snapshot = gw.store.load(identity)
        except StoreUnavailable:
            time.sleep(0.05)
            continue
        row = snapshot.row
        if row is None:
            result = gw.acquire(identity, ttl=ttl)
        elif row.released_at is None and row.expires_at > snapshot.now:
            wait = (row.expires_at - snapshot.now).total_seconds()
            time.sleep(min(max(wait, 0.0) + 0.005, 0.5))
            continue
        else:
            result = gw.takeover(identity, ttl=ttl, expected_epoch=row.epoch)
        if result is not None and result.ok and result.lease is not None:
            return result.lease, clockskew.real_monotonic() - began
    return None, clockskew.real_monotonic() - began


def role_victim(cfg: Config) -> None:
    """Scenario 4: a gateway that is killed with SIGKILL while it works.

    On start it is the *restarted* gateway of the previous victim: it presents every grant
    the previous one minted (rebuilt byte for byte from its dump) and must have all refused,
    then takes each identity over once the old lease has expired (none may be stuck). Then
    it works (heartbeat, grant, validate, sometimes release and take over again) until the
    harness kills it, dumping each grant it mints before using it.
    """
    gw = Gateway({**cfg, "durable": True})
    idents = identities(cfg)
    ttl = float(cfg["ttl"])
    old = read_dump(cfg.get("prev_dump"))
    replayed_ok = 0
    for fields in old:
        forged = replica(fields)
        result = gw.validate(forged, tag="replay")
        replayed_ok += bool(result is not None and result.ok)
    leases: dict[LeaseIdentity, LeaseHandle] = {}
    stuck: list[str] = []
    waits: list[float] = []
    for identity in idents:
        lease, waited = _take_when_expired(gw, identity, ttl, patience=ttl + 5.0)
        waits.append(waited)
        if lease is None:
            stuck.append(str(identity))
        else:
            leases[identity] = lease
    if cfg.get("final"):
        gw.summary(replayed=len(old), replayed_ok=replayed_ok, stuck=stuck, waits=waits)
        gw.close()
        return
    dump_fd = os.open(str(cfg["dump"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    say("READY")
    rng = random.Random(int(cfg.get("seed", 0)))
    iteration = 0
    while not gw.out_of_time():
        iteration += 1
        for identity, lease in list(leases.items()):
            if rng.random() < 0.12:
                released = gw.release(lease)
                if released is not None and released.ok:
                    taken = gw.takeover(identity, ttl=ttl, expected_epoch=lease.epoch)
                    if taken is not None and taken.lease is not None:
                        leases[identity] = taken.lease
                continue
            beat = gw.heartbeat(lease, ttl=ttl)
            current = beat.lease if beat is not None and beat.lease is not None else lease
            leases[identity] = current
            granted = gw.issue_grant(current, ttl=min(ttl, 30.0))
            if granted is not None and granted.grant is not None:
                os.write(dump_fd, (json.dumps(grant_fields(granted.grant)) + "\n").encode())
                gw.validate(granted.grant)
    os.close(dump_fd)
    gw.summary(replayed=len(old), replayed_ok=replayed_ok, stuck=stuck, waits=waits,
               iterations=iteration)
    gw.close()


def role_load(cfg: Config) -> None:
    """Scenario 6: steady work on own identities while the harness stops and restarts the
    server. A ``StoreUnavailable`` is transient: the worker keeps its lease and grant and
    tries again (validations included, which must be refused while the server is down).
    After a refusal or an in-doubt write it finds its lease again by rereading the row, as a
    gateway would."""
    gw = Gateway(cfg)
    idents = identities(cfg)
    ttl = float(cfg["ttl"])
    leases: dict[LeaseIdentity, LeaseHandle | None] = {}
    for identity in idents:
        leases[identity], _ = _take_when_expired(gw, identity, ttl, patience=10)
    say("READY")
    rng = random.Random(int(cfg.get("seed", 0)))
    grants: dict[LeaseIdentity, ExecutionGrant | None] = dict.fromkeys(idents)

    def lost() -> bool:
        # Refused, or outcome unknown: reread before going on. Unavailable: try again.
        return gw.rec.records[-1].status in (Status.DENIED, Status.UNKNOWN)

    while not stop_requested(cfg) and not gw.out_of_time():
        for identity in idents:
            grant = grants[identity]
            if grant is not None:
                gw.validate(grant)
            lease = leases[identity]
            if lease is None:
                lease = leases[identity] = _resync(gw, identity, ttl)
                if lease is None:
                    continue
            roll = rng.random()
            if roll < 0.08:
                released = gw.release(lease)
                if released is None or not released.ok:
                    leases[identity] = None if lost() else lease
                    continue
                taken = gw.takeover(identity, ttl=ttl, expected_epoch=lease.epoch)
                leases[identity] = taken.lease if taken is not None and taken.ok else None
                grants[identity] = None
            elif roll < 0.5:
                beat = gw.heartbeat(lease, ttl=ttl)
                if beat is not None and beat.ok:
                    leases[identity] = beat.lease
                elif lost():
                    leases[identity] = None
            else:
                granted = gw.issue_grant(lease, ttl=min(ttl, 30.0))
                if granted is not None and granted.grant is not None:
                    grants[identity] = granted.grant
                elif lost():
                    leases[identity] = None
        time.sleep(0.002)
    gw.summary()
    gw.close()


def _resync(gw: Gateway, identity: LeaseIdentity, ttl: float) -> LeaseHandle | None:
    """Find this connector's lease again after an error: adopt the row if it is ours and
    active, else take over once it is over."""
    try:
        snapshot = gw.store.load(identity)
    except MosLeaseError:
        return None
    row = snapshot.row
    if row is None:
        result = gw.acquire(identity, ttl=ttl)
    elif row.connector_id == gw.connector and row.released_at is None \
            and row.expires_at > snapshot.now:
        return LeaseHandle.of(row)  # a handle is plain data; the store matches every field
    elif row.released_at is not None or row.expires_at <= snapshot.now:
        result = gw.takeover(identity, ttl=ttl, expected_epoch=row.epoch)
    else:
        return None
    return result.lease if result is not None and result.ok else None


def role_skew(cfg: Config) -> None:
    """Scenario 7: a gateway with skewed clocks runs a seeded mix of operations on its own
    identities, by its own (wrong) sense of time; the harness judges every decision against
    an oracle of database time."""
    offset, rate = float(cfg["offset"]), float(cfg["rate"])
    if (offset, rate) != (0.0, 1.0) and clockskew.installed() != (offset, rate):
        raise SystemExit("clock skew was not installed")
    patched = clockskew.patch_library_datetimes() if clockskew.installed() else 0
    gw = Gateway({**cfg, "policy": "no_preempt"})
    idents = identities(cfg)
    ttl, grant_ttl = float(cfg["ttl"]), float(cfg["grant_ttl"])
    rng = random.Random(int(cfg.get("seed", 0)))
    leases: dict[LeaseIdentity, LeaseHandle | None] = dict.fromkeys(idents)
    epochs: dict[LeaseIdentity, int] = dict.fromkeys(idents, 0)
    grants: dict[LeaseIdentity, deque[ExecutionGrant]] = {i: deque(maxlen=3) for i in idents}
    # What this process believes, against the database clock: proof that the skew is on.
    db_start = gw.rec.clock().now()
    # The datetime the library's modules read now (the skewed one where it was installed).
    library_datetime = next(
        (module.datetime for name, module in sorted(sys.modules.items())
         if name.startswith("mos_lease") and isinstance(getattr(module, "datetime", None), type)
         and module.datetime is not datetime), datetime)
    # Each as of the install, whenever this runs: a clock at 2x gains a second per second of
    # start-up, which a loaded machine makes long.
    observed = {"time_offset": time.time() - db_start.timestamp() - clockskew.gained(),
                "datetime_offset": (library_datetime.now(UTC) - db_start).total_seconds()
                - clockskew.gained()}
    say("READY")
    local_wall_start = time.time()  # the skewed clock: what the gateway believes
    real_start = clockskew.real_monotonic()
    while not gw.out_of_time():
        identity = rng.choice(idents)
        lease = leases[identity]
        roll = rng.random()
        if lease is None or roll < 0.08:
            # (Re)gain: acquire when no row, else take over (refused while active: the
            # policy does not preempt, and the oracle knows whether it was active).
            if epochs[identity] == 0:
                result = gw.acquire(identity, ttl=ttl)
            else:
                result = gw.takeover(identity, ttl=ttl, expected_epoch=epochs[identity])
            if result is not None and result.ok and result.lease is not None:
                leases[identity] = result.lease
                epochs[identity] = result.lease.epoch
        elif roll < 0.12:
            gw.acquire(identity, ttl=ttl)  # lease_held or takeover_required: time decides
        elif roll < 0.35:
            beat = gw.heartbeat(lease, ttl=ttl)
            if beat is not None and beat.ok and beat.lease is not None:
                leases[identity] = beat.lease
        elif roll < 0.38:
            gw.release(lease)
        elif roll < 0.6:
            granted = gw.issue_grant(lease, ttl=grant_ttl)
            if granted is not None and granted.grant is not None:
                grants[identity].append(granted.grant)
        else:
            for grant in list(grants[identity]):
                gw.validate(grant)
        # Pauses of random length make expiries fall on both sides of operations.
        time.sleep(rng.choice([0.0, 0.0, 0.005, 0.02, 0.06, 0.2, 0.4]))
    gw.summary(patched_datetimes=patched, observed=observed,
               rate_observed=(time.time() - local_wall_start)
               / max(1e-9, clockskew.real_monotonic() - real_start))
    gw.close()


def role_smuggle(cfg: Config) -> None:
    """Scenario 10: another gateway process is handed every byte of grants minted elsewhere
    and presents rebuilt copies; every one must be refused."""
    gw = Gateway(cfg)
    accepted = 0
    tried = 0
    for fields in read_dump(str(cfg["dump"])):
        tried += 1
        result = gw.validate(replica(fields), tag="replay")
        accepted += bool(result is not None and result.ok)
    gw.summary(tried=tried, accepted=accepted)
    gw.close()


ROLES: dict[str, Callable[[Config], None]] = {
    "race": role_race, "storm": role_storm, "holder": role_holder, "victim": role_victim,
    "load": role_load, "skew": role_skew, "smuggle": role_smuggle,
}
