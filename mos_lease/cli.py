"""The ``mos-lease`` command: the demo, and the PostgreSQL operations when installed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mos_lease import demo
from mos_lease.version import installed_version

# The commands mos_lease_pg.cli registers (its COMMANDS; tests/e2e/test_cli.py keeps the two
# equal). Without the pg extra each still answers, with the install hint.
PG_COMMANDS = ("setup", "roles", "migrate", "check", "status", "audit")
PG_MISSING_EXIT = 2
# The modules the pg extra installs. Only their absence means "PostgreSQL support is not
# installed", and psycopg without a libpq that it can load means "install one"; any other
# ImportError from mos_lease_pg is a fault and must be seen as one.
PG_EXTRA_MODULES = frozenset({"psycopg", "psycopg_pool"})


def _pg_unavailable() -> str | None:
    """Why the PostgreSQL commands cannot load, or ``None`` when they can."""
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ModuleNotFoundError as missing:
        if missing.name not in PG_EXTRA_MODULES:
            raise
        return f"PostgreSQL support is not installed ({missing}); pip install 'mos-lease[pg]'"
    except ImportError as no_libpq:
        # psycopg is installed but found no libpq to call: the pg extra leaves the choice of
        # the system's libpq or psycopg's own binary build to the application.
        first = str(no_libpq).splitlines()[0]
        return (f"psycopg cannot load libpq ({first}); install libpq (Debian: apt-get install "
                "libpq5) or pip install 'mos-lease[binary]'")
    return None


def _hint(reason: str) -> int:
    print(reason, file=sys.stderr)
    return PG_MISSING_EXIT


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mos-lease", description="Fenced connector leases for logical agents.")
    parser.add_argument("--version", action="version", version=f"mos-lease {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="scripted failover on the in-memory store")
    demo_parser.set_defaults(func=lambda _args: demo.run())
    reason = _pg_unavailable()
    if reason is not None:
        # Stand-ins without their own options: any arguments at all (``--dsn x --json``,
        # ``--help``) reach the install hint instead of an argparse error about them.
        for name in PG_COMMANDS:
            stub = commands.add_parser(name, help="(needs mos-lease[pg])", add_help=False)
            stub.set_defaults(func=lambda _args: _hint(reason), takes_any_arguments=True)
    else:
        # Any ImportError from here on is a fault of mos_lease_pg, and must be seen as one.
        from mos_lease_pg.cli import register

        register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
