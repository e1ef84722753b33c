"""A gateway's configuration: the bindings it runs, under names of its own choosing.

The identities come from here and nowhere else. An HTTP route names a binding by the name
this file gives it; the tenant, agent and binding ids behind that name never come from a
request. The file (or the ``MOS_LEASE_GATEWAY_CONFIG`` environment variable holding the same
JSON) reads::

    {"connector_id": "gw-a", "endpoint": "http://127.0.0.1:8001", "ttl": 3,
     "clock_step": 0,
     "bindings": [{"name": "ledger", "tenant_id": "acme", "logical_agent_id": "agent-1",
                   "binding_id": "ledger"}]}

``endpoint`` is where this process is reached; it is set as the holder metadata of every
lease the process takes (``{"endpoint": ...}``), so that the other gateways forward there.

A gateway of many bindings need not list them: ``"generate": {"tenants": 20, "agents": 100,
"binding_id": "main"}`` adds one binding per tenant and agent (2,000 here), named
``t{i}-a{j}``, for tenant ``tenant-{i}`` and agent ``agent-{j}`` (``i`` from 0 to
``tenants - 1``, ``j`` likewise), beside or instead of ``bindings``; at most
:data:`MAX_BINDINGS` in all. ``"work": "validate"`` serves a request by validating its grant
and writing nothing (the default, ``"ledger"``, inserts the fenced row); benchmarks use it.

Several processes run as one **fleet** (``docs/fleet.md``) when each is given
``"fleet": {"name": "edge", "members": ["gw-a", "gw-b", "gw-c"]}`` (optionally ``"grace"``,
``"look"`` and ``"weight"``; the library's defaults otherwise): the process joins fleet
``name`` as member ``connector_id``, which must be one of ``members``, with its
``endpoint`` in its member lease and its ``ttl`` as the member lease's (a ttl the member
lease can keep with the library's default safety margin, which covers a step of the
database's clock). The bindings are then shared out among the live members instead of all
held by the first to start. The member lease is the one lease under tenant
``mos-lease.fleet``, which no binding may use.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import attrs

from mos_lease import ConfigurationError, InvalidInput, LeaseIdentity, StaticConnectorPolicy
from mos_lease.fleet import FLEET_TENANT, Fleet
from mos_lease.identity import check_id, check_identity
from mos_lease.keeper import KeeperTiming

ENV: Final = "MOS_LEASE_GATEWAY_CONFIG"
SCOPES: Final = ("recipes:write",)
NAME: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
MAX_BINDINGS: Final = 10_000
# Room for MAX_BINDINGS listed at the longest names and ids, indented; still a bound, so a
# file that is no configuration (a dump, a log) is refused before it is parsed.
MAX_CONFIG_BYTES: Final = 8 * 1024 * 1024
WORKS: Final = ("ledger", "validate")
_KEYS: Final = frozenset({"connector_id", "endpoint", "ttl", "clock_step", "grant_ttl",
                          "max_hops", "forward_timeout", "bindings", "generate", "work",
                          "fleet"})
_BINDING_KEYS: Final = frozenset({"name", "tenant_id", "logical_agent_id", "binding_id"})
_GENERATE_KEYS: Final = frozenset({"tenants", "agents", "binding_id"})
_FLEET_KEYS: Final = frozenset({"name", "members", "grace", "look", "weight"})


class ConfigError(ValueError):
    """The configuration is unusable; the message names the field."""


@attrs.frozen
class RouteBinding:
    """A binding the gateway runs: the name its route uses, and the identity behind it."""

    name: str
    identity: LeaseIdentity


@attrs.frozen
class FleetConfig:
    """The fleet a gateway joins (``"fleet"`` in the configuration): its name, the member
    names of every process in it, and the options of :class:`~mos_lease.fleet.Fleet` it
    was given (``grace``, ``look``, ``weight``: the library's defaults for the others)."""

    name: str
    members: tuple[str, ...]
    options: tuple[tuple[str, float], ...] = ()


@attrs.frozen
class GatewayConfig:
    """One gateway process: who it is, where it is reached, what it runs."""

    connector_id: str
    endpoint: str
    bindings: tuple[RouteBinding, ...]
    ttl: float = 3.0
    # The step in database time the supervisor's margin covers: 0 for one database host, as
    # in these recipes; 2 behind a failover pair, which needs a ttl above 4 s
    # (docs/keeping.md, "the safety margin and the shortest ttl").
    clock_step: float = 0.0
    grant_ttl: float = 2.0
    # How many times one request may be forwarded: a holder that moved while a request was
    # on its way is followed once more, and two processes that each think the other holds a
    # binding cannot pass a request back and forth for ever.
    max_hops: int = 2
    forward_timeout: float = 10.0
    work: str = "ledger"
    fleet: FleetConfig | None = None
    # Routes look a binding up by name on every request: a dict, not a scan of thousands.
    _by_name: dict[str, RouteBinding] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {b.name: b for b in self.bindings})

    @property
    def host(self) -> str:
        """The host this process listens on (from ``endpoint``)."""
        return urlsplit(self.endpoint).hostname or ""

    @property
    def port(self) -> int:
        """The port this process listens on (from ``endpoint``)."""
        return urlsplit(self.endpoint).port or 80

    @property
    def metadata(self) -> dict[str, str]:
        """The holder metadata of every lease this process takes."""
        return {"endpoint": self.endpoint}

    def join(self) -> Fleet | None:
        """The fleet this process joins as member ``connector_id`` (``None`` without one):
        its endpoint in the member lease, renewed with the bindings (the same ttl)."""
        if self.fleet is None:
            return None
        return Fleet(self.fleet.name, self.connector_id, members=self.fleet.members,
                     endpoint=self.endpoint, ttl=self.ttl, **dict(self.fleet.options))

    def binding(self, name: str) -> RouteBinding | None:
        """The configured binding called ``name``, if there is one."""
        return self._by_name.get(name)

    def policy(self) -> StaticConnectorPolicy:
        """This process may hold its own bindings as its own connector, and in a fleet its
        own member lease, never preempting an active holder: a survivor waits for a dead
        holder's lease to expire, and a fleet's successor takes a binding over once its
        holder has released it."""
        fleet = self.join()
        identities = [b.identity for b in self.bindings]
        if fleet is not None:
            identities.append(fleet.identity)
        return StaticConnectorPolicy.from_dict({"rules": [{
            "tenant_id": i.tenant_id, "logical_agent_id": i.logical_agent_id,
            "binding_id": i.binding_id, "connector_id": self.connector_id,
            "scopes": list(SCOPES), "max_lease_ttl": self.ttl,
            "max_grant_ttl": self.grant_ttl, "preempt_active": False} for i in identities]})


def check_endpoint(field: str, value: object) -> str:
    """``http://host:port``, nothing more: no path, query, user or other scheme."""
    if not isinstance(value, str) or len(value) > 200:
        raise ConfigError(f"{field}: an http://host:port string, not {value!r}")
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if (parts.scheme != "http" or not parts.hostname or port is None or parts.path
            or parts.query or parts.fragment or parts.username or parts.password):
        raise ConfigError(f"{field}: an http://host:port string, not {value!r}")
    return value


def _number(raw: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigError(f"{key}: a number from {low} to {high}, not {value!r}")
    return float(value)


def _binding(index: int, raw: object) -> RouteBinding:
    where = f"bindings[{index}]"
    if not isinstance(raw, dict) or set(raw) != _BINDING_KEYS:
        raise ConfigError(f"{where}: an object with exactly {sorted(_BINDING_KEYS)}")
    name = raw["name"]
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(f"{where}.name: {NAME.pattern}, not {name!r}")
    try:
        identity = check_identity(where, LeaseIdentity(
            raw["tenant_id"], raw["logical_agent_id"], raw["binding_id"]))
    except (InvalidInput, TypeError) as bad:
        raise ConfigError(f"{where}: {bad}") from None
    if identity.tenant_id == FLEET_TENANT:
        raise ConfigError(f"{where}.tenant_id: {FLEET_TENANT!r} is reserved for the fleet's "
                          "member leases")
    return RouteBinding(name, identity)


def _generated(raw: object) -> list[RouteBinding]:
    """The bindings ``"generate"`` describes (see the module's docstring)."""
    if raw is None:
        return []
    if not isinstance(raw, dict) or set(raw) != _GENERATE_KEYS:
        raise ConfigError(f"generate: an object with exactly {sorted(_GENERATE_KEYS)}")
    counts = [raw["tenants"], raw["agents"]]
    if any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BINDINGS
           for n in counts) or counts[0] * counts[1] > MAX_BINDINGS:
        raise ConfigError(f"generate: tenants and agents are integers from 1 whose product "
                          f"is at most {MAX_BINDINGS}, not {counts}")
    binding_id = raw["binding_id"]
    try:
        check_id("generate.binding_id", binding_id)
    except (InvalidInput, TypeError) as bad:
        raise ConfigError(str(bad)) from None
    return [RouteBinding(f"t{i}-a{j}", check_identity(
        "generate", LeaseIdentity(f"tenant-{i}", f"agent-{j}", binding_id)))
        for i in range(counts[0]) for j in range(counts[1])]


def parse_config(text: str) -> GatewayConfig:
    """The configuration in ``text`` (JSON), checked; :class:`ConfigError` names what is
    wrong."""
    if len(text.encode("utf-8")) > MAX_CONFIG_BYTES:
        raise ConfigError(f"the configuration is over {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(text)
    except ValueError as bad:
        raise ConfigError(f"the configuration is not JSON: {bad}") from None
    if not isinstance(raw, dict):
        raise ConfigError("the configuration is a JSON object")
    unknown = set(raw) - _KEYS
    if unknown:
        raise ConfigError(f"unknown keys {sorted(unknown)}; known: {sorted(_KEYS)}")
    try:
        connector_id = check_id("connector_id", raw.get("connector_id"))
    except InvalidInput as bad:
        raise ConfigError(str(bad)) from None
    bindings = raw.get("bindings", [] if "generate" in raw else None)
    if not isinstance(bindings, list) or len(bindings) > MAX_BINDINGS:
        raise ConfigError(f"bindings: a list of at most {MAX_BINDINGS} bindings")
    checked = (*(_binding(i, b) for i, b in enumerate(bindings)),
               *_generated(raw.get("generate")))
    if not 1 <= len(checked) <= MAX_BINDINGS:
        raise ConfigError(f"bindings: 1 to {MAX_BINDINGS} bindings in all (listed and "
                          f"generated), not {len(checked)}")
    for what, values in (("name", [b.name for b in checked]),
                         ("identity", [b.identity for b in checked])):
        if len(set(values)) != len(values):
            raise ConfigError(f"bindings: two bindings have the same {what}")
    max_hops = raw.get("max_hops", 2)
    if isinstance(max_hops, bool) or not isinstance(max_hops, int) or not 0 <= max_hops <= 8:
        raise ConfigError(f"max_hops: an integer from 0 to 8, not {max_hops!r}")
    ttl = _number(raw, "ttl", 3.0, 1.0, 300.0)
    work = raw.get("work", "ledger")
    if work not in WORKS:
        raise ConfigError(f"work: one of {list(WORKS)}, not {work!r}")
    config = GatewayConfig(
        connector_id, check_endpoint("endpoint", raw.get("endpoint")), checked, ttl=ttl,
        clock_step=_number(raw, "clock_step", 0.0, 0.0, 10.0),
        grant_ttl=_number(raw, "grant_ttl", min(ttl, 2.0), 0.1, min(ttl, 30.0)),
        max_hops=max_hops, forward_timeout=_number(raw, "forward_timeout", 10.0, 0.1, 60.0),
        work=work, fleet=_fleet(raw.get("fleet")))
    try:
        fleet = config.join()  # the library checks the fleet's options
        if fleet is not None:
            # The member lease is kept with the default safety margin (a step of the
            # database's clock included), whatever clock_step the bindings use.
            KeeperTiming(fleet.ttl)
    except ConfigurationError as bad:
        raise ConfigError(f"ttl: too short for a fleet's member lease: {bad}") from None
    except InvalidInput as bad:
        # Named as the configuration names it: "fleet.look", "fleet.members", ...
        field = "connector_id" if bad.field == "member" else f"fleet.{bad.field}"
        raise ConfigError(f"{field}: {bad.message}") from None
    return config


def _fleet(raw: object) -> FleetConfig | None:
    """The fleet ``"fleet"`` describes (see the module's docstring); its values are checked
    by :class:`~mos_lease.fleet.Fleet` as :func:`parse_config` joins it."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not {"name", "members"} <= set(raw) <= _FLEET_KEYS:
        raise ConfigError(f"fleet: an object with \"name\" and \"members\", and optionally "
                          f"{sorted(_FLEET_KEYS - {'name', 'members'})}")
    members = raw["members"]
    if not isinstance(members, list):
        raise ConfigError(f"fleet.members: a list of member names, not {members!r}")
    options = sorted((key, value) for key, value in raw.items() if key not in {"name",
                                                                            "members"})
    for key, value in options:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"fleet.{key}: a number, not {value!r}")
    return FleetConfig(raw["name"], tuple(members), tuple(options))


def load_config(path: str | None) -> GatewayConfig:
    """The configuration from ``path``, else from ``$MOS_LEASE_GATEWAY_CONFIG``."""
    if path is not None:
        return parse_config(Path(path).read_text(encoding="utf-8"))
    text = os.environ.get(ENV)
    if text is None:
        raise ConfigError(f"give --config FILE or set {ENV} to the configuration's JSON")
    return parse_config(text)
