"""PostgreSQL adapter for mos-lease: the production store, sync and asyncio.

Several gateway processes on several hosts share one database; every lease write is one
guarded statement judged by the database clock. See ``mos_lease_pg/README.md``.
"""

from mos_lease_pg.connection import ConnectionSettings, connect_kwargs, make_pool, open_async_pool
from mos_lease_pg.migrations import (
    Migration,
    MigrationError,
    SecondCopyRefused,
    applied_versions,
    available_migrations,
    migrate,
)
from mos_lease_pg.notices import LeaseNotices
from mos_lease_pg.preflight import SchemaCheck
from mos_lease_pg.roles import apply_roles, role_script
from mos_lease_pg.schema import describe_schema
from mos_lease_pg.statements import DEFAULT_SCHEMA
from mos_lease_pg.store import AsyncPostgresLeaseStore, PostgresLeaseStore

__all__ = [
    "DEFAULT_SCHEMA",
    "AsyncPostgresLeaseStore",
    "ConnectionSettings",
    "LeaseNotices",
    "Migration",
    "MigrationError",
    "PostgresLeaseStore",
    "SchemaCheck",
    "SecondCopyRefused",
    "applied_versions",
    "apply_roles",
    "available_migrations",
    "connect_kwargs",
    "describe_schema",
    "make_pool",
    "migrate",
    "open_async_pool",
    "role_script",
]
