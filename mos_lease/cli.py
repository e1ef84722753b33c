"""The ``mos-lease`` command: the demo, and the PostgreSQL operations when installed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mos_lease import demo


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mos-lease", description="Fenced connector leases for logical agents.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="scripted failover on the in-memory store")
    demo_parser.set_defaults(func=lambda _args: demo.run())
    try:
        from mos_lease_pg.cli import register
    except ImportError as missing:
        reason = f"PostgreSQL support is not installed ({missing}); pip install 'mos-lease[pg]'"

        def unavailable(_args: argparse.Namespace) -> int:
            print(reason, file=sys.stderr)
            return 2

        for name in ("migrate", "status", "audit"):
            stub = commands.add_parser(name, help="(needs mos-lease[pg])")
            stub.add_argument("rest", nargs=argparse.REMAINDER)
            stub.set_defaults(func=unavailable)
    else:
        register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
