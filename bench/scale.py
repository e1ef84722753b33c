"""Validate latency with few and with many lease rows.

One throwaway database holds two schemas, each migrated: one bulk-loaded with ``small``
lease rows, the other with ``large`` (one ``INSERT ... SELECT generate_series`` each, then
``VACUUM ANALYZE``). A store per schema validates grants minted for a sample of rows spread
over its table; blocks on the two alternate, so both run under the same machine conditions,
and the two p50s are compared.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import attrs
import psycopg
from common import SCOPES, CorrectnessError, create_schema, store_connection
from measure import Case, Series, interleave
from pinning import Pinning
from psycopg.conninfo import make_conninfo

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    ExecutionGrant,
    LeaseHandle,
    LeaseIdentity,
)
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from mos_lease_pg.admin import migrate

SAMPLE = 256
TENANT = "scale"

_BULK = b"""
INSERT INTO logical_agent_connector_leases
    (tenant_id, logical_agent_id, binding_id, lease_id, connector_id, allowed_scopes, epoch,
     acquired_at, heartbeat_at, expires_at, released_at, updated_at)
SELECT 'scale', 'agent-' || g, 'main', gen_random_uuid(), 'scale-connector',
       ARRAY['tool:run'], 1, now(), now(), now() + interval '1 day', NULL, now()
FROM generate_series(1, %(n)s) AS g
"""


@attrs.define
class ScaleResult:
    small: int
    large: int
    series: dict[str, Series]
    load_seconds: float

    @property
    def ratio(self) -> float:
        return self.series["large"].p50_us / self.series["small"].p50_us


class _Side:
    """One schema: its rows, its store, and fresh grants for a sample of its rows."""

    def __init__(self, dsn: str, schema: str, rows: int) -> None:
        # The search_path is for the bulk load's own SQL below; the library names the schema.
        self.dsn = make_conninfo(dsn, options=f"-c search_path={schema}")
        create_schema(dsn, schema)
        migrate(self.dsn, schema=schema, allow_second_copy=True)  # two copies, on purpose
        with psycopg.connect(self.dsn) as conn:
            # Fixture rows, not library writes: the schema's transition triggers cap a new
            # lease at 5 minutes, and these must outlive a whole run. Replica mode skips the
            # triggers for this one transaction (the benchmark connects as a superuser).
            conn.execute(b"SET LOCAL session_replication_role = replica")
            conn.execute(_BULK, {"n": rows})
            conn.commit()
            conn.autocommit = True
            conn.execute(b"VACUUM ANALYZE logical_agent_connector_leases")
        self.rows = rows
        self.store = PostgresLeaseStore(self.dsn, settings=ConnectionSettings(schema=schema))
        self.coord = ConnectorLeaseCoordinator(self.store, AllowAllPolicy())
        picks = random.Random(rows).sample(range(1, rows + 1), min(SAMPLE, rows))
        self.identities = [LeaseIdentity(TENANT, f"agent-{g}", "main") for g in picks]
        self.grants: list[ExecutionGrant] = []
        self.minted = 0.0

    def refresh(self, _n: int = 0) -> None:
        if self.grants and time.monotonic() - self.minted < 10:
            return
        grants = []
        for identity in self.identities:
            snapshot = self.store.load(identity)
            assert snapshot.row is not None
            granted = self.coord.issue_grant(LeaseHandle.of(snapshot.row), scopes=SCOPES,
                                             ttl=30)
            if granted.grant is None:
                raise CorrectnessError(f"scale grant refused: {granted.reason}")
            grants.append(granted.grant)
        self.grants, self.minted = grants, time.monotonic()

    def case(self, name: str) -> Case:
        coord, grants, identities, k = self.coord, self.grants, self.identities, len(
            self.identities)

        def call(i: int) -> None:
            j = i % k
            result = coord.validate(grants[j], identity=identities[j], scopes=SCOPES)
            if result.context is None:
                raise CorrectnessError(f"scale validate refused: {result.reason}")

        def setup(n: int) -> None:
            self.refresh(n)
            grants[:] = self.grants

        return Case(name, call, setup=setup)

    def connection(self) -> psycopg.Connection[Any]:
        return store_connection(self.store)


def run(dsn: str, *, small: int, large: int, rounds: int, per_round: int,
        pinning: Pinning, progress: Callable[[str], None]) -> ScaleResult:
    started = time.perf_counter()
    progress(f"scale: loading {small:,} and {large:,} lease rows")
    sides = {"small": _Side(dsn, "scale_small", small), "large": _Side(dsn, "scale_large", large)}
    load_seconds = time.perf_counter() - started
    try:
        for side in sides.values():
            side.refresh()
            pinning.add_backend(side.connection())
        progress("scale: validating")
        series = interleave([sides["small"].case("small"), sides["large"].case("large")],
                            rounds=rounds, per_round=per_round, warmup=min(per_round, SAMPLE))
    finally:
        for side in sides.values():
            side.store.close()
    return ScaleResult(small, large, series, load_seconds)
