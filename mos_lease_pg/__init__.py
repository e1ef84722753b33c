"""PostgreSQL adapter for mos-lease: the production store, sync and asyncio.

Several gateway processes on several hosts share one database; every lease write is one
guarded statement judged by the database clock. This package holds what a gateway imports at
run time; setting a database up and looking after it (migrations, roles, checks, the audit
archive and the ``mos-lease`` commands) is :mod:`mos_lease_pg.admin`, which importing this
package does not load. See ``mos_lease_pg/README.md``.
"""

# First: without the pg extra, say what to install before any module needs psycopg.
from mos_lease_pg import extra  # noqa: F401

# isort: split
from mos_lease_pg.connection import ConnectionSettings, connect_kwargs, make_pool, open_async_pool
from mos_lease_pg.notices import LeaseNotices
from mos_lease_pg.preflight import SchemaCheck
from mos_lease_pg.sql_files import DEFAULT_SCHEMA
from mos_lease_pg.store import AsyncPostgresLeaseStore, PostgresLeaseStore

__all__ = [
    "DEFAULT_SCHEMA",
    "AsyncPostgresLeaseStore",
    "ConnectionSettings",
    "LeaseNotices",
    "PostgresLeaseStore",
    "SchemaCheck",
    "connect_kwargs",
    "make_pool",
    "open_async_pool",
]
