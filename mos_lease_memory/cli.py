"""The in-memory adapter's command, registered for ``mos-lease`` by its entry point."""

from __future__ import annotations

from mos_lease.cli import Commands
from mos_lease_memory import demo


def add_demo(commands: Commands) -> None:
    """Add ``mos-lease demo``: the scripted failover on the in-memory store."""
    demo_parser = commands.add_parser("demo", help="scripted failover on the in-memory store")
    demo_parser.set_defaults(func=lambda _args: demo.run())
