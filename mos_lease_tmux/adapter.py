"""The tmux pane adapter: fenced, stamped command lines.

For each call the adapter, holding an exclusive lock for the tmux server:

1. asks the resource guard to admit the context's fencing token for this pane, and
2. only if admitted, types ``export MOS_FENCE=<token>; <command>`` into the pane and presses
   Enter, in one tmux invocation.

The lock (``flock`` on a file beside the tmux socket, so it also holds between processes on
the host, which is as far as a tmux socket reaches) makes "admit, then send" atomic with
respect to every other sender. Without it a connector admitted at epoch 1 could be
overtaken by one admitted at epoch 2 and still type its keys afterwards. With it, the
commands that reach the pane are in non-decreasing epoch order, and once a newer epoch has
reached the pane no older one ever does.

The stamp is an exported variable rather than a comment so that the command, and what it
starts, can pass the token on to its own effect boundaries (``$MOS_FENCE``). The token
grants nothing; it only lets a boundary refuse what is older.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
from pathlib import Path
from typing import Final

import attrs

from mos_lease.context import ConnectorExecutionContext
from mos_lease.errors import InvalidInput
from mos_lease.fencing import FenceReason, ResourceGuard, check_resource_id
from mos_lease.token import FencingToken, format_token
from mos_lease_tmux.server import TmuxServer

MAX_COMMAND_LENGTH: Final = 4096
ENV_VAR: Final = "MOS_FENCE"


@attrs.frozen(slots=True)
class TmuxSendResult:
    """What happened to one command. ``token`` is the stamp, sent or not."""

    sent: bool
    reason: FenceReason | None
    highest_epoch: int | None
    token: str

    @property
    def ok(self) -> bool:
        return self.sent


def check_command(command: object) -> str:
    """One complete shell command line, or ``InvalidInput`` (field ``"command"``).

    Control characters are refused because typed into a terminal they act: a newline would
    run a second, unstamped command; tab completes; ^C interrupts. A trailing backslash
    would join the *next* sender's command onto this line.
    """
    if not isinstance(command, str):
        raise InvalidInput("command", f"must be a str, not {type(command).__name__}")
    if not command.strip():
        raise InvalidInput("command", "must not be empty")
    if len(command) > MAX_COMMAND_LENGTH:
        raise InvalidInput("command", f"must be at most {MAX_COMMAND_LENGTH} characters")
    for ch in command:
        if ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F:
            raise InvalidInput("command", f"must not contain control characters "
                               f"(U+{ord(ch):04X})")
    if command.endswith("\\"):
        raise InvalidInput("command", "must not end with a line continuation")
    return command


def stamp(token_text: str, command: str) -> str:
    """The line typed into the pane: the token exported, then the command."""
    return f"export {ENV_VAR}={token_text}; {command}"


def _tmux_literal(text: str) -> str:
    # tmux splits its argv into commands at an argument *ending* in ";", and turns a final
    # "\;" into ";". A backslash inserted before a final ";" therefore arrives as exactly
    # the text given: "x;" is sent as "x\;", and "x\;" as "x\\;".
    return text[:-1] + "\\;" if text.endswith(";") else text


def default_resource_id(server: TmuxServer, pane_id: str) -> str:
    """``tmux:<host and socket digest>:<pane id>``: one name per pane per host."""
    where = f"{socket.gethostname()}:{os.path.abspath(server.socket_path)}"
    return f"tmux:{hashlib.sha256(where.encode()).hexdigest()[:16]}:{pane_id}"


class TmuxPaneAdapter:
    """Sends fenced command lines to one tmux pane (a :class:`ConnectorAdapter` whose
    request is the command line).

    ``guard`` remembers the highest epoch that reached the pane (an in-memory guard for one
    gateway process, :class:`mos_lease_pg.fencing.PostgresResourceGuard` for several).
    ``signing_key`` signs the stamped token for boundaries that share it.
    """

    def __init__(self, server: TmuxServer, target: str, guard: ResourceGuard, *,
                 resource_id: str | None = None, signing_key: bytes | None = None) -> None:
        self.server = server
        self.pane_id = server.pane_id(target)
        self.guard = guard
        self.resource_id = check_resource_id(
            resource_id if resource_id is not None
            else default_resource_id(server, self.pane_id))
        self.signing_key = signing_key
        self.lock_path = Path(f"{server.socket_path}.mos-lease.lock")

    def execute(self, context: ConnectorExecutionContext, command: str, /) -> TmuxSendResult:
        line = check_command(command)
        token = FencingToken.from_context(context)
        text = format_token(token, key=self.signing_key)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            decision = self.guard.admit(self.resource_id, token)
            if not decision.ok:
                return TmuxSendResult(False, decision.reason, decision.highest_epoch, text)
            self.server.run("send-keys", "-t", self.pane_id, "-l",
                            _tmux_literal(stamp(text, line)),
                            ";", "send-keys", "-t", self.pane_id, "Enter")
            return TmuxSendResult(True, None, decision.highest_epoch, text)
        finally:
            os.close(fd)  # closing the only descriptor releases the lock
