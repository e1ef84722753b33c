"""The gateways' command line and their output, shared: ``setup`` makes the effect table and
grants it, ``serve`` (the default) runs the gateway; each lifecycle change is one JSON line on
stdout, for the operator (and the tests)."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from examples.recipes import ledger
from examples.recipes.config import ConfigError, GatewayConfig, load_config
from mos_lease.supervisor import BindingLost, BindingStarted, Change, Moved
from mos_lease_pg.admin.roles import DEFAULT_GATEWAY_ROLE

GC_THRESHOLDS = (50_000, 20, 100)
"""The garbage collector's thresholds for a gateway process (``gc.set_threshold``; the
default is ``(700, 10, 10)``). A gateway of thousands of bindings keeps a few hundred thousand
long-lived objects, and a burst of takeovers allocates thousands more that live for a batch:
at the default, the collector walks them again and again. Measured at a fleet member's
SIGTERM (three members, 10,000 bindings), it took 0.44 and 0.85 s of the two successors'
2.3 s of CPU; at these thresholds it did not run, and the bindings moved in 1.4 s instead of
2.4 (p99; ``docs/fleet.md``). The library's objects free themselves by reference counting
(they form no cycles), so collecting less often costs no memory that stays."""


def tune_gc() -> None:
    """Set :data:`GC_THRESHOLDS` for this process: once, at a gateway's start."""
    gc.set_threshold(*GC_THRESHOLDS)


STOP_WAKE = 0.5
"""How often, in seconds, :func:`wait_for_stop` wakes the main thread to run a signal's
handler."""


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: the threaded gateway's way to stop."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_stop(stop: threading.Event) -> None:
    """Wait in the main thread until ``stop`` is set, waking every :data:`STOP_WAKE` s.

    Python runs a signal's handler in the main thread, but the kernel may deliver a signal
    sent to the process to any of its threads. An untimed ``stop.wait()`` is cut short only
    by a signal delivered to the main thread itself: one that lands on a request's thread
    leaves the handler pending and the main thread asleep, and the gateway serves on (a
    WSGI gateway was seen still serving 30 s after its SIGTERM). A timed wait returns to
    the interpreter, which runs the pending handler."""
    while not stop.wait(STOP_WAKE):
        pass


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout per lifecycle change (a supervisor's thread writes too)."""
    print(json.dumps({"event": event, **fields}, default=str), flush=True)


def on_change(change: Change) -> None:
    """Print the supervisor's changes: a binding started or lost here, or handed over to
    another member of the fleet."""
    if isinstance(change, BindingStarted):
        emit("binding_started", identity=str(change.identity), epoch=change.lease.epoch)
    elif isinstance(change, BindingLost):
        emit("binding_lost", identity=str(change.identity), cause=str(change.loss.cause))
    elif isinstance(change, Moved):
        emit("binding_moved", identity=str(change.identity), epoch=change.lease.epoch,
             successor=change.successor)


def parse_args(argv: Sequence[str], description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("command", choices=["serve", "setup"], nargs="?", default="serve")
    default_dsn = os.environ.get("MOS_LEASE_DSN")
    parser.add_argument("--dsn", default=default_dsn, required=default_dsn is None,
                        help="as the gateway role (serve) or a superuser (setup); default "
                             "$MOS_LEASE_DSN")
    parser.add_argument("--config", default=None,
                        help="the configuration's JSON file (default: the JSON in "
                             "$MOS_LEASE_GATEWAY_CONFIG)")
    parser.add_argument("--gateway-role", default=DEFAULT_GATEWAY_ROLE,
                        help="for setup: the role the gateways connect as")
    return parser.parse_args(argv)


def run(name: str, description: str, argv: Sequence[str] | None,
        serve: Callable[[GatewayConfig, str], int]) -> int:
    """The gateway ``name``'s command: ``setup``, or ``serve`` its configuration with
    ``serve(config, dsn)``; exit status 2 for a configuration it cannot read."""
    args = parse_args(sys.argv[1:] if argv is None else argv, description)
    if args.command == "setup":
        ledger.set_up(args.dsn, args.gateway_role)
        emit("set_up", table=ledger.TABLE, gateway_role=args.gateway_role)
        return 0
    try:
        config = load_config(args.config)
    except (ConfigError, OSError) as bad:
        print(f"{name}: {bad}", file=sys.stderr)
        return 2
    # A process that does not stop, or answers slowly, says where each thread is on
    # ``kill -USR1 <pid>``: every thread's stack on stderr, and it runs on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    tune_gc()
    return serve(config, args.dsn)
