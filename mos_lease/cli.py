"""The ``mos-lease`` command. Its subcommands come from the adapters installed beside the
core, which the core does not import: each adapter registers one entry point per command in
the group ``mos_lease.cli`` (its ``pyproject.toml``), named as the command, whose object adds
that command to the parser (:data:`AddCommand`). ``mos_lease_memory`` adds ``demo``;
``mos_lease_pg`` adds the PostgreSQL commands.

An adapter whose extra is not installed raises :class:`~mos_lease.errors.MissingExtra` at
import; its commands are then still listed, and each answers with the message saying what to
install. Any other failure to load an adapter is a fault of that adapter and is raised as one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, TypeAlias

from mos_lease.errors import MissingExtra
from mos_lease.version import installed_version

GROUP = "mos_lease.cli"
MISSING_EXTRA_EXIT = 2

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
AddCommand: TypeAlias = Callable[[Commands], Any]
"""What an entry point of the group names: adds its command (a subparser whose defaults set
``func``, called with the parsed arguments and returning the exit status)."""


def _stand_in(commands: Commands, name: str, reason: str) -> None:
    # Without options of its own: any arguments at all (``--dsn x --json``, ``--help``)
    # reach the install hint instead of an argparse error about them.
    def hint(_args: argparse.Namespace) -> int:
        print(reason, file=sys.stderr)
        return MISSING_EXTRA_EXIT

    stub = commands.add_parser(name, help="(needs an extra: see its message)", add_help=False)
    stub.set_defaults(func=hint, takes_any_arguments=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mos-lease", description="Fenced connector leases for logical agents.")
    parser.add_argument("--version", action="version", version=f"mos-lease {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    for point in sorted(entry_points(group=GROUP), key=lambda point: point.name):
        try:
            add: AddCommand = point.load()
        except MissingExtra as missing:
            _stand_in(commands, point.name, str(missing))
            continue
        add(commands)
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
