"""mos-lease beside its peers, in one run: redis-py's ``Lock`` and PostgreSQL advisory locks.

    python bench/peers.py [--quick] [--redis URL] [--bindings N]

Each side is measured at 1 and at 32 concurrent callers (``CALLERS``), in interleaved rounds
(every case once per round, the order rotated from round to round), as operations per
second over all callers:

* redis-py ``Lock.extend`` (one ``EVALSHA`` of the lock's Lua script, TTL replaced) and the
  token check ``Lock.owned`` (a ``GET`` compared with the lock's token), each caller on a
  lock of its own, with threads on one ``redis.Redis`` and with tasks on one
  ``redis.asyncio.Redis`` (each client's own connection pool);
* PostgreSQL advisory locks, each caller on a session (connection) of its own, threads: a
  check that the session still holds its session-level lock (``pg_locks``), and a
  ``pg_try_advisory_lock`` with its ``pg_advisory_unlock`` in one statement;
* ours: ``validate`` of each caller's own binding's grant, with tasks on one
  ``AsyncConnectorLeaseCoordinator`` over one ``AsyncPostgresLeaseStore``, and with threads on
  one ``ConnectorLeaseCoordinator`` over one ``PostgresLeaseStore`` (every validation rereads
  the lease row: one round trip each on the store's one connection, or fewer where the store
  shares reads between callers); the supervisors' whole renewal ticks (:func:`tick_cases`);
  and, reported beside them, the supervisor's leases renewed per second in real time
  (``bench/supervisor.py``, measured by the caller of :func:`run`).

Two ratios come out: ``renewal_vs_redis_extend``, the leases renewed per second by whole
renewal ticks of a ``Supervisor`` and an ``AsyncSupervisor`` (each holding the run's
bindings, driven turn by turn as cases of the same rounds: the slower of the two) over the
fastest ``Lock.extend`` rate of the same round (whichever caller count and client kind), the
median of the per-round ratios, and
``validate_vs_redis_check``, validations per second at 32 callers over token checks per
second at 32 callers (the faster client kind of each side, round by round; the median over
rounds). Beside them, what each side guarantees: a faster answer that promises less is not
the same answer.

Redis is found at ``--redis`` (default ``$MOS_LEASE_BENCH_REDIS`` or
redis://127.0.0.1:6379/0); where none answers, its cases are skipped with a line saying so,
and the rest still runs. Keys live under a prefix of their own and are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import importlib.util
import itertools
import os
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
import attrs
import psycopg
import supervisor
from common import (
    LEASE_TTL,
    SCOPES,
    BenchError,
    CorrectnessError,
    failed,
    server,
    throwaway_database,
)

from examples.recipes.command import tune_gc
from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    ExecutionGrant,
    LeaseHandle,
    LeaseIdentity,
)
from mos_lease.supervisor import AsyncSupervisor, BindingLost, Change, Supervisor
from mos_lease_pg import AsyncPostgresLeaseStore, PostgresLeaseStore

if TYPE_CHECKING:  # imported where used: without redis-py, the rest of the run still runs
    import redis
    import redis.asyncio
    import redis.asyncio.lock
    import redis.lock

CALLERS = (1, 32)
# Each case's name in bench/run.py's table, by (side, op).
SHORT = {("redis", "extend"): "redis Lock.extend", ("redis", "check"): "redis Lock.owned",
         ("postgres", "check"): "advisory held?", ("postgres", "try_lock"): "advisory try+unlock",
         ("ours", "validate"): "validate()", ("ours", "renew"): "supervisor ticks"}
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
GRANT_TTL = 30  # the cap; grants are minted again before every round
CONNECTOR = "bench-peer"
TARGETS = {"renewal_vs_redis_extend": 1.5, "validate_vs_redis_check": 1.0}
# The tick cases' renewal connections (``heartbeat_coordinator``): a supervisor keeps two
# batches of a tick in flight, and on two connections they run at once (redis-py's side
# has its clients' connection pools).
RENEWAL_CONNECTIONS = 2


@attrs.frozen
class PeerSize:
    rounds: int
    seconds: float  # per case per round


FULL = PeerSize(rounds=5, seconds=1.0)
QUICK = PeerSize(rounds=2, seconds=0.3)


@attrs.frozen
class Case:
    side: str  # "redis", "postgres", "ours"
    op: str  # "extend", "check", "try_lock", "validate"
    callers: int
    kind: str  # "threads" or "tasks"
    label: str
    run: Callable[[float], tuple[int, float]]  # seconds -> (operations, elapsed seconds)

    @property
    def key(self) -> str:
        return f"{self.side}:{self.op}:{self.callers}:{self.kind}"


@attrs.define
class PeerResult:
    rates: dict[str, list[float]]  # Case.key -> operations per second, one per round
    labels: dict[str, str]
    redis_skipped: str | None  # the line printed instead of Redis's figures
    guarantees: list[tuple[str, str, str, str]]  # side, durability, fencing, audit
    supervisor_leases_per_s: float
    renewal_vs_redis_extend: float | None
    validate_vs_redis_check: float | None
    validate_by_kind: dict[str, float]  # "threads"/"tasks" -> ours / redis, same kind

    def median(self, key: str) -> float:
        return statistics.median(self.rates[key])


# --- driving N callers -------------------------------------------------------------------


def drive_threads(ops: Sequence[Callable[[], None]], seconds: float) -> tuple[int, float]:
    """Each op on a thread of its own, in a loop, for ``seconds``; all start together."""
    counts = [0] * len(ops)
    barrier = threading.Barrier(len(ops) + 1)
    end = [0.0]
    failures: list[BaseException] = []

    def work(i: int) -> None:
        op = ops[i]
        barrier.wait()
        stop, n = end[0], 0
        try:
            while time.perf_counter() < stop:
                op()
                n += 1
        except BaseException as error:  # reported by the main thread
            failures.append(error)
        counts[i] = n

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(ops))]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    end[0] = start + seconds
    barrier.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if failures:
        raise failures[0]
    return sum(counts), elapsed


def drive_tasks_in(runner: asyncio.Runner, ops: Sequence[Callable[[], Awaitable[None]]],
                   seconds: float) -> tuple[int, float]:
    """:func:`drive_tasks` on ``runner``'s loop (where the clients and stores live)."""
    return runner.run(drive_tasks(ops, seconds))


async def drive_tasks(ops: Sequence[Callable[[], Awaitable[None]]],
                      seconds: float) -> tuple[int, float]:
    """Each op in a task of its own on the running loop, in a loop, for ``seconds``."""
    start = time.perf_counter()
    stop = start + seconds

    async def work(op: Callable[[], Awaitable[None]]) -> int:
        n = 0
        while time.perf_counter() < stop:
            await op()
            n += 1
        return n

    counts = await asyncio.gather(*(work(op) for op in ops))
    return sum(counts), time.perf_counter() - start


def require(ok: bool, what: str) -> None:
    if not ok:
        raise CorrectnessError(what)


# --- Redis -------------------------------------------------------------------------------


def redis_absent(url: str) -> str | None:
    """``None`` when Redis answers at ``url``, else the line that says it was skipped."""
    if importlib.util.find_spec("redis") is None:
        return (f"skipped: no Redis client for {url} (redis-py is not installed: the bench "
                "extra, pip install -e '.[bench]')")
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
    try:
        client.ping()
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as error:
        return f"skipped: no Redis on {url} ({error})"
    finally:
        client.close()
    return None


def redis_durability(client: redis.Redis) -> str:
    """What this Redis keeps on disk, from its own configuration."""
    import redis

    try:
        config = {**client.config_get("appendonly"), **client.config_get("appendfsync"),
                  **client.config_get("save")}
    except redis.exceptions.ResponseError:
        return "unknown (CONFIG GET refused)"
    aof = config.get("appendonly") == "yes"
    snapshots = bool(config.get("save"))
    if not aof and not snapshots:
        return "none: nothing on disk (appendonly no, save \"\"); a restart forgets every lock"
    parts = [f"AOF appendfsync {config.get('appendfsync')}" if aof else "",
             f"snapshots (save {config.get('save')})" if snapshots else ""]
    return (", ".join(p for p in parts if p) + "; a write acknowledged before its fsync can "
            "be lost")


def redis_cases(url: str, prefix: str, stack: ExitStack, runner: asyncio.Runner,
                ttl: int) -> list[Case]:
    import redis
    import redis.asyncio.lock
    import redis.lock

    n = max(CALLERS)
    client = redis.Redis.from_url(url, max_connections=2 * n)
    stack.callback(client.close)
    stack.callback(_delete_keys, client, prefix)
    locks = [redis.lock.Lock(client, f"{prefix}:t:{i}", timeout=ttl, thread_local=False)
             for i in range(n)]
    for lock in locks:
        require(lock.acquire(blocking=False), "a fresh Redis lock was not acquired")

    def extend(lock: redis.lock.Lock) -> Callable[[], None]:
        def op() -> None:
            require(lock.extend(ttl, replace_ttl=True), "Lock.extend refused a held lock")
        return op

    def check(lock: redis.lock.Lock) -> Callable[[], None]:
        def op() -> None:
            require(lock.owned(), "Lock.owned() said no for a held lock")
        return op

    aclient: redis.asyncio.Redis = runner.run(_async_client(url, 2 * n))
    stack.callback(lambda: runner.run(aclient.aclose()))
    alocks = [redis.asyncio.lock.Lock(aclient, f"{prefix}:a:{i}", timeout=ttl,
                                      thread_local=False) for i in range(n)]
    for alock in alocks:
        require(runner.run(alock.acquire(blocking=False)), "a fresh Redis lock was not acquired")

    def aextend(lock: redis.asyncio.lock.Lock) -> Callable[[], Awaitable[None]]:
        async def op() -> None:
            require(await lock.extend(ttl, replace_ttl=True), "Lock.extend refused a held lock")
        return op

    def acheck(lock: redis.asyncio.lock.Lock) -> Callable[[], Awaitable[None]]:
        async def op() -> None:
            require(await lock.owned(), "Lock.owned() said no for a held lock")
        return op

    cases = []
    for callers in CALLERS:
        for op, label, sync_op, async_op in (
                ("extend", "redis-py Lock.extend", extend, aextend),
                ("check", "redis-py Lock.owned (GET)", check, acheck)):
            sync_ops = [sync_op(lock) for lock in locks[:callers]]
            async_ops = [async_op(lock) for lock in alocks[:callers]]
            cases.append(Case("redis", op, callers, "threads", label,
                              functools.partial(drive_threads, sync_ops)))
            cases.append(Case("redis", op, callers, "tasks", label,
                              functools.partial(drive_tasks_in, runner, async_ops)))
    return cases


def _delete_keys(client: redis.Redis, prefix: str) -> None:
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)


async def _async_client(url: str, connections: int) -> redis.asyncio.Redis:
    # Made on the runner's loop: an asyncio client belongs to the loop it first runs on.
    import redis.asyncio

    return redis.asyncio.Redis.from_url(url, max_connections=connections)


# --- PostgreSQL advisory locks -----------------------------------------------------------

HOLDS = ("SELECT EXISTS (SELECT FROM pg_catalog.pg_locks WHERE locktype = 'advisory' "
         "AND pid = pg_catalog.pg_backend_pid() AND classid = 0 AND objid = %s "
         "AND objsubid = 1 AND granted)")
TRY_LOCK = "SELECT pg_catalog.pg_try_advisory_lock(%s), pg_catalog.pg_advisory_unlock(%s)"


def advisory_cases(dsn: str, stack: ExitStack) -> list[Case]:
    """One session per caller: an advisory lock belongs to the session that took it."""
    n = max(CALLERS)
    base = secrets.randbelow(1 << 30)  # keys of this run only (classid 0: below 2**32)
    conns = [stack.enter_context(psycopg.connect(dsn, autocommit=True)) for _ in range(n)]
    for i, conn in enumerate(conns):
        conn.execute("SELECT pg_catalog.pg_advisory_lock(%s)", (base + i,))

    def holds(conn: psycopg.Connection[Any], key: int) -> Callable[[], None]:
        def op() -> None:
            row = conn.execute(HOLDS, (key,), prepare=True).fetchone()
            require(row is not None and row[0] is True, "a session lost its advisory lock")
        return op

    def try_lock(conn: psycopg.Connection[Any], key: int) -> Callable[[], None]:
        def op() -> None:
            row = conn.execute(TRY_LOCK, (key, key), prepare=True).fetchone()
            require(row == (True, True), f"pg_try_advisory_lock / unlock returned {row}")
        return op

    cases = []
    for callers in CALLERS:
        for op, label, make, offset in (
                ("check", "advisory lock held? (pg_locks)", holds, 0),
                ("try_lock", "pg_try_advisory_lock + unlock", try_lock, n)):
            ops = [make(conns[i], base + offset + i) for i in range(callers)]
            cases.append(Case("postgres", op, callers, "threads", label,
                              functools.partial(drive_threads, ops)))
    return cases


# --- ours --------------------------------------------------------------------------------


@attrs.define
class Validators:
    """Each caller's binding, lease and grant on one coordinator; grants are minted again
    (untimed) before every round, so none runs out during one."""

    coordinator: ConnectorLeaseCoordinator
    identities: list[LeaseIdentity]
    leases: list[LeaseHandle] = attrs.field(factory=list)
    grants: list[ExecutionGrant] = attrs.field(factory=list)

    def hold(self) -> None:
        for identity in self.identities:
            acquired = self.coordinator.acquire(identity, CONNECTOR, scopes=SCOPES,
                                                ttl=LEASE_TTL)
            require(acquired.lease is not None, f"acquire refused: {acquired.reason}")
            assert acquired.lease is not None
            self.leases.append(acquired.lease)

    def refresh(self) -> None:
        self.coordinator.heartbeat_many(self.leases, ttl=LEASE_TTL)
        self.grants = []
        for lease in self.leases:
            granted = self.coordinator.issue_grant(lease, scopes=SCOPES, ttl=GRANT_TTL)
            require(granted.grant is not None, f"issue_grant refused: {granted.reason}")
            assert granted.grant is not None
            self.grants.append(granted.grant)

    def op(self, i: int) -> Callable[[], None]:
        def validate() -> None:
            result = self.coordinator.validate(self.grants[i], identity=self.identities[i],
                                               scopes=SCOPES)
            require(result.ok, f"a live grant was refused: {result.reason}")
        return validate


@attrs.define
class AsyncValidators:
    """As :class:`Validators`, on the asyncio coordinator."""

    coordinator: AsyncConnectorLeaseCoordinator
    identities: list[LeaseIdentity]
    leases: list[LeaseHandle] = attrs.field(factory=list)
    grants: list[ExecutionGrant] = attrs.field(factory=list)

    async def hold(self) -> None:
        for identity in self.identities:
            acquired = await self.coordinator.acquire(identity, CONNECTOR, scopes=SCOPES,
                                                      ttl=LEASE_TTL)
            require(acquired.lease is not None, f"acquire refused: {acquired.reason}")
            assert acquired.lease is not None
            self.leases.append(acquired.lease)

    async def refresh(self) -> None:
        await self.coordinator.heartbeat_many(self.leases, ttl=LEASE_TTL)
        self.grants = []
        for lease in self.leases:
            granted = await self.coordinator.issue_grant(lease, scopes=SCOPES, ttl=GRANT_TTL)
            require(granted.grant is not None, f"issue_grant refused: {granted.reason}")
            assert granted.grant is not None
            self.grants.append(granted.grant)

    def op(self, i: int) -> Callable[[], Awaitable[None]]:
        async def validate() -> None:
            result = await self.coordinator.validate(self.grants[i],
                                                     identity=self.identities[i],
                                                     scopes=SCOPES)
            require(result.ok, f"a live grant was refused: {result.reason}")
        return validate


def our_cases(dsn: str, tenant: str, stack: ExitStack,
              runner: asyncio.Runner) -> tuple[list[Case], Callable[[], None]]:
    """The validate cases, and what to run (untimed) before each round."""
    n = max(CALLERS)
    store = stack.enter_context(PostgresLeaseStore(dsn))
    sync = Validators(ConnectorLeaseCoordinator(store, AllowAllPolicy()),
                      [LeaseIdentity(tenant, f"threads-{i}", "main") for i in range(n)])
    sync.hold()

    async def open_async() -> AsyncValidators:
        astore = AsyncPostgresLeaseStore(dsn)
        stack.callback(lambda: runner.run(astore.aclose()))
        validators = AsyncValidators(
            AsyncConnectorLeaseCoordinator(astore, AllowAllPolicy()),
            [LeaseIdentity(tenant, f"tasks-{i}", "main") for i in range(n)])
        await validators.hold()
        return validators

    tasks = runner.run(open_async())

    def refresh() -> None:
        sync.refresh()
        runner.run(tasks.refresh())

    cases = []
    label = "validate()"
    for callers in CALLERS:
        sync_ops = [sync.op(i) for i in range(callers)]
        async_ops = [tasks.op(i) for i in range(callers)]
        cases.append(Case("ours", "validate", callers, "threads", label,
                          functools.partial(drive_threads, sync_ops)))
        cases.append(Case("ours", "validate", callers, "tasks", label,
                          functools.partial(drive_tasks_in, runner, async_ops)))
    return cases, refresh


# --- the supervisor's renewal ticks, in the same rounds ---------------------------------


class _TickClock:
    """The supervisor's clock in the tick cases: moved a renewal interval on before each
    turn, so that every turn is one whole renewal tick (every lease due). Renewing sooner
    in real time than the ttl asks is safe (a deadline only moves later)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def gateway_gc() -> Iterator[None]:
    """The recipes' collector thresholds (``tune_gc``) inside the block, this process's
    own again after it."""
    before = gc.get_threshold()
    tune_gc()
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _closer(runner: asyncio.Runner, store: AsyncPostgresLeaseStore) -> Callable[[], None]:
    """A callback that closes ``store`` on ``runner``'s loop."""
    return lambda: runner.run(store.aclose())


async def _no_sleep(_seconds: float) -> None:
    """A turn with nothing due returns at once: the cases move the clock themselves."""


def tick_cases(dsn: str, tenant: str, bindings: int, stack: ExitStack,
               runner: asyncio.Runner) -> list[Case]:
    """A :class:`~mos_lease.supervisor.Supervisor` and an :class:`~mos_lease.supervisor.
    AsyncSupervisor`, each holding ``bindings`` leases on stores of its own (one dedicated
    connection for its campaign, and :data:`RENEWAL_CONNECTIONS` for its renewals, one batch
    in flight on each), driven turn by turn: a case runs whole renewal ticks for its seconds
    and counts the leases renewed, so the supervisor is measured in the same rounds as
    ``Lock.extend`` (and under the same load), not minutes apart."""
    interval = LEASE_TTL / 3  # the default renew_fraction, no jitter (the supervisor's)
    lost: list[Change] = []

    def tally(change: Change) -> None:
        if isinstance(change, BindingLost):
            lost.append(change)

    names = [LeaseIdentity(tenant, f"tick-{i}", "main") for i in range(bindings)]
    sync_clock, async_clock = _TickClock(), _TickClock()
    store = stack.enter_context(PostgresLeaseStore(dsn))
    renewers = [ConnectorLeaseCoordinator(stack.enter_context(PostgresLeaseStore(dsn)),
                                          AllowAllPolicy()) for _ in range(RENEWAL_CONNECTIONS)]
    sync = Supervisor(ConnectorLeaseCoordinator(store, AllowAllPolicy()), clock=sync_clock,
                      sleep=lambda _s: None, background=False, on_change=tally,
                      heartbeat_coordinator=renewers)
    stack.callback(sync.close)
    for identity in names:
        sync.add(identity, CONNECTOR, scopes=SCOPES, ttl=LEASE_TTL)
    while sync.stats().bindings_held < bindings:
        sync.turn()

    async def open_async() -> AsyncSupervisor:
        astore = AsyncPostgresLeaseStore(dsn)
        stores = [AsyncPostgresLeaseStore(dsn) for _ in range(RENEWAL_CONNECTIONS)]
        supervisor = AsyncSupervisor(AsyncConnectorLeaseCoordinator(astore, AllowAllPolicy()),
                                     clock=async_clock, sleep=_no_sleep,
                                     background=False, on_change=tally,
                                     heartbeat_coordinator=[
                                         AsyncConnectorLeaseCoordinator(each, AllowAllPolicy())
                                         for each in stores])
        for each in [astore, *stores]:
            stack.callback(_closer(runner, each))
        stack.callback(lambda: runner.run(supervisor.close()))
        for identity in [LeaseIdentity(tenant, f"atick-{i}", "main") for i in range(bindings)]:
            supervisor.add(identity, CONNECTOR, scopes=SCOPES, ttl=LEASE_TTL)
        while supervisor.stats().bindings_held < bindings:
            await supervisor.turn()
        return supervisor

    tasks = runner.run(open_async())

    def ticks(turn: Callable[[], object], clock: _TickClock,
              renewed: Callable[[], int], seconds: float) -> tuple[int, float]:
        before = renewed()
        start = time.perf_counter()
        while True:
            clock.now += interval + 0.001
            turn()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        require(not lost, f"a binding was lost during the renewal ticks: {lost[:1]}")
        return renewed() - before, elapsed

    def async_turn() -> object:
        return runner.run(tasks.turn())

    return [
        Case("ours", "renew", bindings, "threads", "supervisor renewal ticks",
             functools.partial(ticks, sync.turn, sync_clock, lambda: sync.stats().leases_renewed)),
        Case("ours", "renew", bindings, "tasks", "supervisor renewal ticks",
             functools.partial(ticks, async_turn, async_clock,
                               lambda: tasks.stats().leases_renewed)),
    ]


# --- the run -----------------------------------------------------------------------------


def postgres_durability(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        fsync = conn.execute("SHOW fsync").fetchone()
        commit = conn.execute("SHOW synchronous_commit").fetchone()
    return (f"fsync={fsync[0] if fsync else '?'}, synchronous_commit="
            f"{commit[0] if commit else '?'}: every write flushed to disk at its commit")


def guarantees(redis_line: str | None, pg_line: str) -> list[tuple[str, str, str, str]]:
    rows = [
        ("mos-lease (PostgreSQL)", pg_line,
         "epoch + lease UUID, checked by every validate and carried downstream",
         "one row per write attempt, in its transaction; denied validations too"),
        ("PostgreSQL advisory lock", "none: session state in memory, gone with the session",
         "none: no token; a holder learns of a lost session at its next statement",
         "none"),
    ]
    if redis_line is not None:
        rows.insert(1, ("redis-py Lock (this Redis)", redis_line,
                        "none: a random token checked by the lock's own scripts only, "
                        "nothing ordered to hand downstream", "none"))
    return rows


def run(dsn: str, tenant: str, size: PeerSize, supervisor_leases_per_s: float,
        redis_url: str, progress: Callable[[str], None], bindings: int = 10_000
        ) -> PeerResult:
    """Every case of every side present, ``size.rounds`` interleaved rounds, the
    supervisor's renewal ticks at ``bindings`` leases among them; the supervisor's rate of
    ``bench/supervisor.py`` (real time) is measured by the caller in the same run and
    reported beside them."""
    skipped = redis_absent(redis_url)
    if skipped is not None:
        progress(skipped)
    prefix = f"mos-lease-bench:{secrets.token_hex(4)}"
    redis_line = None
    # The stack closes first: its callbacks still run coroutines on the runner's loop. The
    # collector's thresholds are the recipes' gateways' (tune_gc) while the cases run, as in
    # bench/standby.py and bench/fleet.py: the tick cases' supervisors hold a gateway's
    # bindings, and at the default thresholds collections over their objects take a quarter
    # of the renewal ticks' time (the asyncio supervisor, 10,000 bindings, two renewal
    # connections, runs alternated on one machine: 21,200-24,600 leases/s at the default
    # thresholds, 27,600-33,300 at the recipes').
    with asyncio.Runner() as runner, ExitStack() as stack, gateway_gc():
        cases: list[Case] = []
        if skipped is None:
            import redis

            cases += redis_cases(redis_url, prefix, stack, runner, LEASE_TTL)
            with redis.Redis.from_url(redis_url) as client:
                redis_line = redis_durability(client)
        cases += advisory_cases(dsn, stack)
        ours, refresh = our_cases(dsn, tenant, stack, runner)
        cases += ours
        cases += tick_cases(dsn, f"{tenant}-ticks", bindings, stack, runner)
        rates: dict[str, list[float]] = {case.key: [] for case in cases}
        refresh()
        for case in cases:  # warm-up: connections opened, statements prepared, scripts loaded
            case.run(min(0.05, size.seconds))
        for k in range(size.rounds):
            progress(f"peers: round {k + 1} of {size.rounds}, {len(cases)} cases of "
                     f"{size.seconds:g} s")
            refresh()
            shift = k % len(cases)
            for case in itertools.chain(cases[shift:], cases[:shift]):
                count, elapsed = case.run(size.seconds)
                rates[case.key].append(count / elapsed)
        labels = {case.key: case.label for case in cases}
    result = PeerResult(rates, labels, skipped, guarantees(redis_line, postgres_durability(dsn)),
                        supervisor_leases_per_s, None, None, {})
    if skipped is None:
        # Round by round: the slower supervisor's renewal ticks over the fastest
        # Lock.extend (of 1 and 32 callers, threads and tasks) of the same round.
        extends = [rates[f"redis:extend:{c}:{kind}"] for c in CALLERS
                   for kind in ("threads", "tasks")]
        ticks = [rates[f"ours:renew:{bindings}:{kind}"] for kind in ("threads", "tasks")]
        result.renewal_vs_redis_extend = statistics.median(
            min(ours) / max(theirs) for ours, theirs in zip(zip(*ticks, strict=True),
                                                            zip(*extends, strict=True),
                                                            strict=True))
        n = max(CALLERS)
        ours_best = [max(a, b) for a, b in zip(rates[f"ours:validate:{n}:threads"],
                                               rates[f"ours:validate:{n}:tasks"], strict=True)]
        redis_best = [max(a, b) for a, b in zip(rates[f"redis:check:{n}:threads"],
                                                rates[f"redis:check:{n}:tasks"], strict=True)]
        result.validate_vs_redis_check = statistics.median(
            o / r for o, r in zip(ours_best, redis_best, strict=True))
        for kind in ("threads", "tasks"):
            result.validate_by_kind[kind] = statistics.median(
                o / r for o, r in zip(rates[f"ours:validate:{n}:{kind}"],
                                      rates[f"redis:check:{n}:{kind}"], strict=True))
    return result


def report(result: PeerResult) -> list[str]:
    """The lines to print: every rate, the two ratios with their targets, and the table of
    what each side guarantees."""
    lines = []
    if result.redis_skipped is not None:
        lines.append(result.redis_skipped)
    lines.append(f"{'side':<9} {'operation':<32} {'callers':>7} {'kind':<8} {'ops/s':>10}")
    for key in result.rates:
        side, _op, callers, kind = key.split(":")
        lines.append(f"{side:<9} {result.labels[key]:<32} {callers:>7} {kind:<8} "
                     f"{result.median(key):>10,.0f}")
    lines.append(f"{'ours':<9} {'supervisor: leases renewed':<32} {'1':>7} {'one':<8} "
                 f"{result.supervisor_leases_per_s:>10,.0f}")
    n = max(CALLERS)
    if result.renewal_vs_redis_extend is not None:
        lines.append(f"renewal_vs_redis_extend: {result.renewal_vs_redis_extend:.2f} (the "
                     "slower supervisor's renewal ticks over the fastest Lock.extend of the "
                     "same round, median of per-round ratios; target >= "
                     f"{TARGETS['renewal_vs_redis_extend']:g})")
    if result.validate_vs_redis_check is not None:
        by_kind = ", ".join(f"{kind} {value:.2f}" for kind, value in
                            result.validate_by_kind.items())
        lines.append(f"validate_vs_redis_check: {result.validate_vs_redis_check:.2f} at {n} "
                     f"callers (the faster kind of each side, median of per-round ratios; "
                     f"same kind: {by_kind}; target >= "
                     f"{TARGETS['validate_vs_redis_check']:g})")
    lines.append("what each side guarantees:")
    width = max(len(row[0]) for row in result.guarantees)
    for side, durability, fencing, audit in result.guarantees:
        lines.append(f"  {side:<{width}}  durability: {durability}")
        lines.append(f"  {'':<{width}}  fencing token: {fencing}")
        lines.append(f"  {'':<{width}}  audit: {audit}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short rounds, fewer bindings")
    parser.add_argument("--redis", default=os.environ.get("MOS_LEASE_BENCH_REDIS",
                                                          DEFAULT_REDIS))
    parser.add_argument("--bindings", type=int, default=None,
                        help="bindings the supervisor holds (default: 10,000; --quick 2,000)")
    args = parser.parse_args(argv)
    size = supervisor.QUICK_SIZE if args.quick else supervisor.FULL_SIZE
    if args.bindings is not None:
        if args.bindings < 1:
            parser.error("--bindings must be at least 1")
        size = attrs.evolve(size, bindings=args.bindings, singles=min(size.singles,
                                                                      args.bindings))

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        srv = server()
        try:
            with throwaway_database(srv, "mos_lease_bench_peers") as dsn:
                progress(f"supervisor: {size.bindings:,} bindings")
                held = supervisor.run(dsn, attrs.evolve(size, asynchronous=False))
                result = run(dsn, f"bench-peers-{secrets.token_hex(4)}",
                             QUICK if args.quick else FULL, held.leases_per_s, args.redis,
                             progress, size.bindings)
        finally:
            srv.stop()
    except (BenchError, CorrectnessError) as error:
        return failed(error)
    for line in report(result):
        print(line)
    print(f"load average at end {os.getloadavg()[0]:.2f} (a shared machine: absolute rates "
          "are noise; compare the ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
