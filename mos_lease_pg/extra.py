"""The pg extra, checked before anything of this package loads: without psycopg and
psycopg_pool, or with a psycopg that finds no libpq to call, importing ``mos_lease_pg`` raises
:class:`mos_lease.errors.MissingExtra` saying what to install (the ``mos-lease`` command shows
that for each PostgreSQL command). Any other failure to import is a fault and stays one."""

from mos_lease.errors import MissingExtra

# The modules the pg extra installs: only their absence means the extra is missing.
PG_EXTRA_MODULES = frozenset({"psycopg", "psycopg_pool"})

try:
    import psycopg  # noqa: F401
    import psycopg_pool  # noqa: F401
except ModuleNotFoundError as missing:
    if missing.name not in PG_EXTRA_MODULES:
        raise
    raise MissingExtra(f"PostgreSQL support is not installed ({missing}); "
                       "pip install 'mos-lease[pg]'") from missing
except ImportError as no_libpq:
    # psycopg is installed but found no libpq to call: the pg extra leaves the choice of the
    # system's libpq or psycopg's own binary build to the application.
    first = str(no_libpq).splitlines()[0]
    raise MissingExtra(f"psycopg cannot load libpq ({first}); install libpq (Debian: "
                       "apt-get install libpq5) or pip install 'mos-lease[binary]'"
                       ) from no_libpq
