"""Coalesced validation: validations per second with 1, 8 and 32 concurrent callers on one
store, in one run.

    python bench/coalesce.py [--rounds 8] [--per-block 960] [--no-threads] [--no-grants]

Finds PostgreSQL as the tests do and works in a throwaway database. 32 bindings each hold a
lease and a grant; a block runs ``--per-block`` validations split over N callers (each
validating its own binding's grant in a loop), and its rate is validations over the block's
wall time. N is 1, 8 and 32, in rounds whose order rotates; a ratio is the median over rounds
of the per-round ratio of the N-caller rate to the 1-caller rate:

* ``coalesced_validate_8_vs_single``, ``coalesced_validate_32_vs_single``: asyncio tasks on
  one ``AsyncConnectorLeaseCoordinator`` over one ``AsyncPostgresLeaseStore`` (its dedicated
  connection), the loads that overlap sharing a round trip (``mos_lease_pg.coalesce``);
* the same with threads on one ``ConnectorLeaseCoordinator`` over one ``PostgresLeaseStore``
  (``..._threads``);
* beside them, in the same rounds, the store as it was before coalescing (every load its own
  round trip, taken in turn on the connection): ``..._vs_uncoalesced``;
* grant issues (a load, then the audit row) at 8 and 32 tasks against one:
  ``coalesced_grant_8_vs_single``, ``coalesced_grant_32_vs_single`` (grants/s over the
  single-caller rate: overlapping grants share their loads and their audit rows' statement
  and commit), and against the store before coalescing (``..._vs_uncoalesced``).

Every validation must succeed (exit status 3 otherwise). Absolute rates on a shared machine
are noise; the ratios are measured side by side. Exit status: 0 ran, 2 could not run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
import attrs
from common import SCOPES, BenchError, CorrectnessError, server, throwaway_database

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    ExecutionGrant,
    LeaseHandle,
    LeaseIdentity,
)
from mos_lease.records import AuditEntry, Snapshot
from mos_lease_pg import AsyncPostgresLeaseStore, PostgresLeaseStore, statements

CALLERS = (1, 8, 32)
TARGETS = {"coalesced_validate_8_vs_single": 2.5, "coalesced_validate_32_vs_single": 4.5,
           "coalesced_grant_8_vs_single": 2.5, "coalesced_grant_32_vs_single": 4.5}


class UncoalescedStore(PostgresLeaseStore):
    """The store as it was before coalescing: one statement per load, one statement and
    one commit per audit append."""

    def load(self, identity: LeaseIdentity) -> Snapshot:
        return self._run(statements.load(identity, self._offset, schema=self._schema))

    def record(self, entry: AuditEntry) -> None:
        self._record_one(entry, self._deadline(None))


class AsyncUncoalescedStore(AsyncPostgresLeaseStore):
    """As :class:`UncoalescedStore`, asyncio."""

    async def load(self, identity: LeaseIdentity) -> Snapshot:
        return await self._run(statements.load(identity, self._offset, schema=self._schema))

    async def record(self, entry: AuditEntry) -> None:
        await self._record_one(entry, self._deadline(None))


@attrs.define
class Flavour:
    """One flavour's blocks: for each case (``"8"``, ``"8 before"``, ...), the rate of each
    round."""

    rates: dict[str, list[float]] = attrs.field(factory=dict)

    def add(self, case: str, rate: float) -> None:
        self.rates.setdefault(case, []).append(rate)

    def rate(self, case: str) -> float:
        return statistics.median(self.rates[case])

    def ratio(self, case: str, floor: str) -> float:
        return statistics.median(a / b for a, b in zip(self.rates[case], self.rates[floor],
                                                        strict=True))


@attrs.frozen
class CoalesceResult:
    tasks: Flavour
    threads: Flavour | None
    grants: Flavour | None

    def figures(self) -> dict[str, float]:
        out = {f"coalesced_validate_{n}_vs_single": self.tasks.ratio(str(n), "1")
               for n in CALLERS[1:]}
        for n in CALLERS[1:]:
            out[f"coalesced_validate_{n}_vs_uncoalesced"] = self.tasks.ratio(str(n),
                                                                             f"{n} before")
        if self.threads is not None:
            for n in CALLERS[1:]:
                out[f"coalesced_validate_{n}_vs_single_threads"] = self.threads.ratio(
                    str(n), "1")
                out[f"coalesced_validate_{n}_vs_uncoalesced_threads"] = self.threads.ratio(
                    str(n), f"{n} before")
        if self.grants is not None:
            for n in CALLERS[1:]:
                out[f"coalesced_grant_{n}_vs_single"] = self.grants.ratio(str(n), "1")
                out[f"coalesced_grant_{n}_vs_uncoalesced"] = self.grants.ratio(
                    str(n), f"{n} before")
        return out


def cases() -> list[tuple[str, int, bool]]:
    """(case, callers, coalesced) for one round: 1, 8, 32, and 8 and 32 before."""
    return [(str(n), n, True) for n in CALLERS] + [
        (f"{n} before", n, False) for n in CALLERS[1:]]


def _rotated(items: Sequence[Any], by: int) -> list[Any]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def _shares(total: int, callers: int) -> list[int]:
    each, extra = divmod(total, callers)
    return [each + (1 if i < extra else 0) for i in range(callers)]


def _identities(tenant: str) -> list[LeaseIdentity]:
    return [LeaseIdentity(tenant, f"agent-{i}", "main") for i in range(max(CALLERS))]


# --- asyncio ------------------------------------------------------------------------------


async def _async_setup(coordinator: AsyncConnectorLeaseCoordinator,
                       identities: Sequence[LeaseIdentity]) -> list[LeaseHandle]:
    leases = []
    for identity in identities:
        acquired = await coordinator.acquire(identity, "c", scopes=SCOPES, ttl=300)
        if acquired.lease is None:
            raise CorrectnessError(f"acquire refused: {acquired.reason}")
        leases.append(acquired.lease)
    return leases


async def _async_grants(coordinator: AsyncConnectorLeaseCoordinator,
                        leases: Sequence[LeaseHandle]) -> list[ExecutionGrant]:
    grants = []
    for lease in leases:
        granted = await coordinator.issue_grant(lease, scopes=SCOPES, ttl=30)
        if granted.grant is None:
            raise CorrectnessError(f"grant refused: {granted.reason}")
        grants.append(granted.grant)
    return grants


async def _async_block(callers: int, total: int,
                       one: Callable[[int], Awaitable[None]]) -> float:
    async def caller(index: int, count: int) -> None:
        for _ in range(count):
            await one(index)

    started = time.perf_counter()
    await asyncio.gather(*(caller(i, n) for i, n in enumerate(_shares(total, callers))))
    return total / (time.perf_counter() - started)


async def _async_run(dsn: str, tenant: str, rounds: int, per_block: int, grants: bool,
                     progress: Callable[[str], None]) -> tuple[Flavour, Flavour | None]:
    identities = _identities(tenant)
    async with AsyncPostgresLeaseStore(dsn) as store, AsyncUncoalescedStore(dsn) as before:
        coordinators = {True: AsyncConnectorLeaseCoordinator(store, AllowAllPolicy()),
                        False: AsyncConnectorLeaseCoordinator(before, AllowAllPolicy())}
        leases = await _async_setup(coordinators[True], identities)
        validated, issued = Flavour(), Flavour() if grants else None
        for round_no in range(rounds):
            progress(f"coalesce: asyncio round {round_no + 1}/{rounds}")
            minted = {coalesced: await _async_grants(c, leases)
                      for coalesced, c in coordinators.items()}
            for case, callers, coalesced in _rotated(cases(), round_no):
                coordinator, own = coordinators[coalesced], minted[coalesced]

                async def validate(i: int, c: AsyncConnectorLeaseCoordinator = coordinator,
                                   g: list[ExecutionGrant] = own) -> None:
                    result = await c.validate(g[i], identity=identities[i], scopes=SCOPES)
                    if not result.ok:
                        raise CorrectnessError(f"validation refused: {result.reason}")

                validated.add(case, await _async_block(callers, per_block, validate))
                if issued is not None:
                    async def issue(i: int, c: AsyncConnectorLeaseCoordinator = coordinator
                                    ) -> None:
                        result = await c.issue_grant(leases[i], scopes=SCOPES, ttl=30)
                        if result.grant is None:
                            raise CorrectnessError(f"grant refused: {result.reason}")

                    issued.add(case, await _async_block(callers, per_block // 2, issue))
        return validated, issued


# --- threads ------------------------------------------------------------------------------


def _thread_block(callers: int, total: int, one: Callable[[int], None]) -> float:
    start = threading.Barrier(callers + 1)
    failures: list[BaseException] = []

    def caller(index: int, count: int) -> None:
        start.wait()
        try:
            for _ in range(count):
                one(index)
        except BaseException as error:  # reported by the block
            failures.append(error)

    threads = [threading.Thread(target=caller, args=(i, n), daemon=True)
               for i, n in enumerate(_shares(total, callers))]
    for thread in threads:
        thread.start()
    start.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise failures[0]
    return total / elapsed


def _thread_run(dsn: str, tenant: str, rounds: int, per_block: int,
                progress: Callable[[str], None]) -> Flavour:
    identities = _identities(f"{tenant}-t")
    with PostgresLeaseStore(dsn) as store, UncoalescedStore(dsn) as before:
        coordinators = {True: ConnectorLeaseCoordinator(store, AllowAllPolicy()),
                        False: ConnectorLeaseCoordinator(before, AllowAllPolicy())}
        leases = []
        for identity in identities:
            acquired = coordinators[True].acquire(identity, "c", scopes=SCOPES, ttl=300)
            if acquired.lease is None:
                raise CorrectnessError(f"acquire refused: {acquired.reason}")
            leases.append(acquired.lease)
        validated = Flavour()
        for round_no in range(rounds):
            progress(f"coalesce: threads round {round_no + 1}/{rounds}")
            minted: dict[bool, list[ExecutionGrant]] = {}
            for coalesced, c in coordinators.items():
                minted[coalesced] = []
                for lease in leases:
                    grant = c.issue_grant(lease, scopes=SCOPES, ttl=30).grant
                    if grant is None:
                        raise CorrectnessError("grant refused")
                    minted[coalesced].append(grant)
            for case, callers, coalesced in _rotated(cases(), round_no):
                coordinator, own = coordinators[coalesced], minted[coalesced]

                def validate(i: int, c: ConnectorLeaseCoordinator = coordinator,
                             g: list[ExecutionGrant] = own) -> None:
                    result = c.validate(g[i], identity=identities[i], scopes=SCOPES)
                    if not result.ok:
                        raise CorrectnessError(f"validation refused: {result.reason}")

                validated.add(case, _thread_block(callers, per_block, validate))
        return validated


def run(dsn: str, tenant: str, *, rounds: int, per_block: int, threads: bool = True,
        grants: bool = True, progress: Callable[[str], None] = lambda _m: None
        ) -> CoalesceResult:
    """Measure everything above in the database ``dsn`` (migrated), for bindings of
    ``tenant``."""
    tasks, issued = asyncio.run(_async_run(dsn, tenant, rounds, per_block, grants, progress))
    threaded = _thread_run(dsn, tenant, rounds, per_block, progress) if threads else None
    return CoalesceResult(tasks, threaded, issued)


def render(result: CoalesceResult) -> str:
    lines = []
    for name, flavour, unit in (("asyncio validate", result.tasks, "validations/s"),
                                ("threads validate", result.threads, "validations/s"),
                                ("asyncio grant issue", result.grants, "grants/s")):
        if flavour is None:
            continue
        for case, _callers, _coalesced in cases():
            lines.append(f"{name:<20} {case + ' callers':<18} {flavour.rate(case):>10,.0f} "
                         f"{unit}")
    lines.append("")
    for figure, value in result.figures().items():
        target = TARGETS.get(figure)
        judged = "" if target is None else (
            f"   target >= {target:g}: {'met' if value >= target else 'MISSED'}")
        lines.append(f"{figure:<48} {value:6.2f}x{judged}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--per-block", type=int, default=960,
                        help="validations per block, split over its callers")
    parser.add_argument("--no-threads", action="store_true")
    parser.add_argument("--no-grants", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        srv = server()
    except BenchError as exc:
        print(f"bench/coalesce.py: {exc}", file=sys.stderr)
        return 2
    try:
        with throwaway_database(srv, "mos_lease_bench_coalesce") as dsn:
            result = run(dsn, "bench-coalesce", rounds=args.rounds, per_block=args.per_block,
                         threads=not args.no_threads, grants=not args.no_grants,
                         progress=lambda m: print(m, file=sys.stderr, flush=True))
    except CorrectnessError as exc:
        print(f"bench/coalesce.py: correctness: {exc}", file=sys.stderr)
        return 3
    finally:
        srv.stop()
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
