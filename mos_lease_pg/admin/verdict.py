"""The pure half of ``mos-lease check``: the :class:`Facts` read from a server, and
:func:`evaluate`, which turns them into :class:`Item` rows of a :class:`Report` (name,
value, ok / warn / problem and a fix for anything not ok). No I/O, so the judgement is
tested on any facts, including ones a test server cannot produce (a standby, an old server,
synchronous replication); :mod:`mos_lease_pg.admin.check` reads the facts and runs the
command.
"""

from __future__ import annotations

import enum
from typing import Any, Final

import attrs

from mos_lease_pg import preflight
from mos_lease_pg.preflight import SchemaCheck
from mos_lease_pg.translate import POOLER_SETTINGS

CANNOT_CONNECT: Final = 2
# The oldest server the store supports (mos_lease_pg/README.md).
MIN_SERVER_VERSION_NUM: Final = 120000
# A host clock this far from the database's (beyond the measurement's own uncertainty) is
# worth a warning: fencing never reads it, but people compare logs and token expiries.
CLOCK_WARN_SECONDS: Final = 1.0


class Status(enum.Enum):
    OK = "ok"
    WARN = "warn"
    PROBLEM = "problem"


@attrs.frozen(slots=True)
class Item:
    """One line of the report. ``fix`` is set for every item that is not ok."""

    name: str
    value: str
    status: Status
    fix: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "status": self.status.value,
                "fix": self.fix}


@attrs.frozen(slots=True)
class Report:
    items: tuple[Item, ...]

    @property
    def problems(self) -> tuple[Item, ...]:
        return tuple(i for i in self.items if i.status is Status.PROBLEM)

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def as_json(self) -> dict[str, Any]:
        return {"ok": not self.problems, "exit_code": self.exit_code,
                "items": [i.as_json() for i in self.items]}


@attrs.frozen(slots=True)
class ClockReading:
    """Database clock minus this host's clock, in seconds, from the reading with the
    shortest round trip: the true offset lies within ``offset +- uncertainty`` (half that
    round trip), whatever the network did."""

    offset: float
    uncertainty: float


@attrs.frozen(slots=True)
class Facts:
    """Everything :func:`evaluate` judges; :func:`~mos_lease_pg.admin.check.gather` reads it
    from a live server."""

    schema: str
    server_version_num: int
    server_version: str
    role: str
    database: str
    # The store's first-use check: its result, or the ConfigurationError text it raised.
    schema_check: SchemaCheck | None
    schema_error: str | None
    synchronous_commit: str
    synchronous_standby_names: str
    in_recovery: bool
    statement_timeout: str
    lock_timeout: str
    clock: ClockReading
    client_port: int | None  # the port this host connected to
    server_port: int | None  # the port the server says it listens on (None: Unix socket)
    backend_pids: tuple[int, ...]  # the backend of each of several separate transactions
    # The backend pid the connection's startup named (libpq's backend key): a pooler answers
    # the startup itself, with a key of its own (None: not read).
    startup_pid: int | None = None
    # How far the newest lease row stamp lies ahead of the database clock, in seconds
    # (negative: behind it, as it should be), and how many rows were compared (None: the
    # lease table could not be read, or holds no row).
    stamp_lead: float | None = None
    rows_compared: int = 0
    # How many lease rows hold metadata that breaks the rule every write passes (None: not
    # read, or the table holds no row).
    metadata_withheld: int | None = None


def _fix_layout(facts: Facts) -> str:
    return (f"as a superuser: `mos-lease setup --dsn SUPERUSER_DSN --schema {facts.schema}` "
            f"(a new database), or `mos-lease migrate --dsn OWNER_DSN --schema "
            f"{facts.schema}` then `mos-lease roles --dsn SUPERUSER_DSN --schema "
            f"{facts.schema}`")


def _fix_roles(facts: Facts) -> str:
    return (f"as a superuser: `mos-lease roles --dsn SUPERUSER_DSN --schema {facts.schema} "
            f"--gateway-role {facts.role}`")


def _is_privilege_refusal(message: str) -> bool:
    # preflight raises one ConfigurationError at the first stage that fails, in a fixed
    # order: schema exists, role may use it, tables and version, then privileges. Its texts
    # for the two privilege stages are these (tests/pg/test_pg_check.py provokes each stage).
    return " lacks " in message or " may not use schema " in message


def _server_item(facts: Facts) -> Item:
    if facts.server_version_num < MIN_SERVER_VERSION_NUM:
        return Item("server_version", facts.server_version, Status.PROBLEM,
                    "upgrade PostgreSQL to 12 or newer")
    return Item("server_version", facts.server_version, Status.OK)


def _schema_items(facts: Facts) -> list[Item]:
    needed = preflight.required_version()
    found = facts.schema_check
    if found is not None:
        schema = Item("schema", f"{facts.schema} at version {found.version} (needs {needed})",
                      Status.OK)
        if found.version > needed:
            schema = attrs.evolve(schema, status=Status.WARN,
                                  fix="upgrade mos-lease on the gateways to match the schema")
        if found.surplus:
            privileges = Item(
                "privileges", f"role {facts.role}: all needed; surplus: "
                + "; ".join(found.surplus), Status.WARN,
                "gateways should connect as the least-privilege gateway role `mos-lease "
                "roles` creates (the triggers keep the data right either way)")
        else:
            privileges = Item("privileges", f"role {facts.role}: exactly what the store needs",
                              Status.OK)
        return [schema, privileges]
    message = facts.schema_error or "not checked"
    if _is_privilege_refusal(message):
        return [Item("schema", f"{facts.schema} at version {needed} or newer", Status.OK),
                Item("privileges", message, Status.PROBLEM, _fix_roles(facts))]
    return [Item("schema", message, Status.PROBLEM, _fix_layout(facts)),
            Item("privileges", "not checked: the schema comes first", Status.WARN,
                 "fix the schema, then run check again")]


def _durability_items(facts: Facts) -> list[Item]:
    standbys = facts.synchronous_standby_names.strip()
    commit = facts.synchronous_commit
    fix_commit = (f"ALTER ROLE {facts.role} SET synchronous_commit = on (or set it in "
                  "postgresql.conf)")
    if commit == "off":
        commit_item = Item(
            "synchronous_commit", commit, Status.PROBLEM,
            f"{fix_commit}: with off, a crash can lose a takeover already reported "
            "committed, and the same epoch can be handed out again")
    elif commit == "local" and standbys:
        commit_item = Item(
            "synchronous_commit", commit, Status.WARN,
            f"{fix_commit}: with local, commits do not wait for the synchronous standby, so "
            "a failover can lose a committed takeover")
    else:
        commit_item = Item("synchronous_commit", commit, Status.OK)
    if standbys:
        standby_item = Item("synchronous_standby_names", standbys, Status.OK)
    else:
        standby_item = Item(
            "synchronous_standby_names", "(empty: no synchronous standby)", Status.WARN,
            "if this server fails over, configure synchronous replication: a promoted "
            "asynchronous standby can lose a committed takeover and hand the same epoch "
            "out again (a single server without failover needs nothing)")
    if facts.in_recovery:
        recovery = Item("standby", "yes: this server is a read-only standby", Status.PROBLEM,
                        "connect to the primary (with several hosts in the DSN, add "
                        "target_session_attrs=read-write)")
    else:
        recovery = Item("standby", "no (primary)", Status.OK)
    return [commit_item, standby_item, recovery]


def _clock_item(facts: Facts) -> Item:
    clock = facts.clock
    value = (f"database clock {clock.offset:+.4f} s from this host's "
             f"(+- {clock.uncertainty:.4f} s)")
    if abs(clock.offset) - clock.uncertainty > CLOCK_WARN_SECONDS:
        return Item("clock_offset", value, Status.WARN,
                    "synchronize this host's clock (NTP); leases and grants are judged by "
                    "the database clock, so fencing is unaffected, but times read here "
                    "disagree with the database's")
    return Item("clock_offset", value, Status.OK)


def _clock_step_items(facts: Facts) -> list[Item]:
    """A database clock earlier than the newest lease stamp stepped back since that write.
    Only a step back larger than the time since the newest write can be seen here (and, by
    each write, only one larger than the time since that row's own last write)."""
    lead = facts.stamp_lead
    if lead is None:
        return []
    if lead > 0:
        return [Item(
            "clock_steps", f"database clock {lead:.3f} s behind the newest lease stamp "
            f"({facts.rows_compared} rows): it stepped back", Status.PROBLEM,
            "the database host's clock moved backwards (a failover to a host whose clock "
            "is behind, an NTP step): writes to leases stamped after the clock are refused "
            "`clock_behind` until the clock passes their stamps; keep the database hosts' "
            "clocks synchronized (NTP slewing, not stepping) and find why it stepped")]
    return [Item("clock_steps", f"database clock {-lead:.3f} s past the newest lease stamp "
                 f"({facts.rows_compared} rows): no step back seen", Status.OK)]


def _metadata_items(facts: Facts) -> list[Item]:
    """Rows holding metadata written around the library (before migration 0010): a warning,
    not a problem, since every lease operation works on them and reads withhold it."""
    withheld = facts.metadata_withheld
    if withheld is None:
        return []
    if withheld == 0:
        return [Item("holder_metadata", "no lease row holds metadata the library withholds",
                     Status.OK)]
    return [Item(
        "holder_metadata", f"{withheld} lease row(s) hold metadata that breaks the rules a "
        "write passes: written around the library; reads withhold it (metadata_invalid)",
        Status.WARN,
        "kept as written (evidence of who wrote it); the next takeover of each row replaces "
        "it. List them as the owner: SELECT tenant_id, logical_agent_id, binding_id, epoch "
        f"FROM \"{facts.schema}\".logical_agent_connector_leases WHERE \"{facts.schema}\"."
        "mos_lease_metadata_problem(holder_metadata) IS NOT NULL")]


def _pooler_signs(facts: Facts) -> tuple[list[str], bool]:
    """What shows a pooler, and whether it is certainly one that shares server sessions
    (a relay or a port mapping shows only a different port)."""
    signs = []
    pids = set(facts.backend_pids)
    if facts.startup_pid is not None and pids and facts.startup_pid not in pids:
        signs.append(f"the connection's startup named backend pid {facts.startup_pid}, "
                     f"backend {facts.backend_pids[0]} answered (a pooler answers the "
                     "startup itself)")
    if len(pids) > 1:
        signs.append(f"{len(pids)} backends answered {len(facts.backend_pids)} "
                     "transactions (a transaction pooler)")
    certain = bool(signs)
    if (facts.client_port is not None and facts.server_port is not None
            and facts.client_port != facts.server_port):
        signs.append(f"connected to port {facts.client_port}, the server listens on "
                     f"{facts.server_port} (a pooler, proxy or port mapping)")
    return signs, certain


def _pooler_item(facts: Facts, behind_pooler: bool) -> Item:
    signs, certain = _pooler_signs(facts)
    if behind_pooler:
        signs.append("--behind-pooler given")
    if not signs:
        return Item("pooler", "none detected (one backend, same port)", Status.OK)
    fix = (f"behind a transaction pooler, build the store with {POOLER_SETTINGS}: the "
           "pooler may refuse or drop startup options and cannot track prepared statements "
           "(a store with other settings is refused at first use)")
    if certain and not behind_pooler:
        # The check cannot see how the gateways build their stores: an operator who has
        # built them so says --behind-pooler, which also requires the role's timeouts.
        return Item("pooler", "; ".join(signs), Status.PROBLEM,
                    f"{fix}; then run `mos-lease check --behind-pooler`, which also "
                    "requires role default timeouts")
    missing = [name for name, value in (("statement_timeout", facts.statement_timeout),
                                        ("lock_timeout", facts.lock_timeout)) if value == "0"]
    if missing:
        return Item("pooler", "; ".join(signs) + f"; no role default {' or '.join(missing)}",
                    Status.PROBLEM,
                    f"{fix}; the timeouts must then come from role defaults: "
                    f"{_fix_roles(facts)} sets them on the gateway role")
    return Item("pooler", "; ".join(signs) + f"; role defaults: statement_timeout="
                f"{facts.statement_timeout}, lock_timeout={facts.lock_timeout}",
                Status.WARN, fix)


def evaluate(facts: Facts, *, behind_pooler: bool = False) -> Report:
    """Judge ``facts``. ``behind_pooler``: the operator says a transaction pooler is in
    front of the server and the gateways' stores are built for it (without it, a pooler
    detected for certain is a problem, since a store with the default settings is refused
    behind it)."""
    return Report((
        Item("connection", f"role {facts.role} on database {facts.database}", Status.OK),
        _server_item(facts),
        *_schema_items(facts),
        *_durability_items(facts),
        _clock_item(facts),
        *_clock_step_items(facts),
        *_metadata_items(facts),
        _pooler_item(facts, behind_pooler),
    ))


def cannot_connect(error: str) -> Report:
    """The report when no connection could be made (exit code :data:`CANNOT_CONNECT`)."""
    return Report((Item("connection", error, Status.PROBLEM,
                        "check the DSN, that the server runs and that pg_hba.conf admits "
                        "this host and role"),))


def render_text(report: Report) -> str:
    width = max(len(i.name) for i in report.items)
    lines = []
    for item in report.items:
        lines.append(f"{item.status.value:<7}  {item.name:<{width}}  {item.value}")
        if item.fix is not None:
            lines.append(f"{'':<7}  {'':<{width}}  fix: {item.fix}")
    problems = len(report.problems)
    lines.append("no problems" if not problems else f"{problems} problem(s)")
    return "\n".join(lines)
