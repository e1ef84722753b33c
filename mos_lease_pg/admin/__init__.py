"""Setting a PostgreSQL database up for mos-lease and looking after it: the schema migrations
(:mod:`~mos_lease_pg.admin.migrations`), the least-privilege roles
(:mod:`~mos_lease_pg.admin.roles`), the readiness check (:mod:`~mos_lease_pg.admin.check`,
judged by :mod:`~mos_lease_pg.admin.verdict`), the audit archive and partitions
(:mod:`~mos_lease_pg.admin.archive`; the archive's files and their verification without a
database: :mod:`~mos_lease_pg.admin.archive_files`), and the ``mos-lease`` commands that run
them (:mod:`~mos_lease_pg.admin.cli`). A gateway at run time needs none of it, and ``import
mos_lease_pg`` loads none of it.
"""

from mos_lease_pg.admin.migrations import SecondCopyRefused, applied_versions, migrate
from mos_lease_pg.admin.roles import apply_roles, role_script
from mos_lease_pg.admin.schema import describe_schema
from mos_lease_pg.versions import Migration, MigrationError, available_migrations

__all__ = [
    "Migration",
    "MigrationError",
    "SecondCopyRefused",
    "applied_versions",
    "apply_roles",
    "available_migrations",
    "describe_schema",
    "migrate",
    "role_script",
]
