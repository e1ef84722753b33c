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

from mos_lease import InvalidInput, LeaseIdentity, StaticConnectorPolicy
from mos_lease.identity import check_id, check_identity

ENV: Final = "MOS_LEASE_GATEWAY_CONFIG"
SCOPES: Final = ("recipes:write",)
NAME: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
MAX_CONFIG_BYTES: Final = 64 * 1024
MAX_BINDINGS: Final = 10_000
WORKS: Final = ("ledger", "validate")
_KEYS: Final = frozenset({"connector_id", "endpoint", "ttl", "clock_step", "grant_ttl",
                          "max_hops", "forward_timeout", "bindings", "generate", "work"})
_BINDING_KEYS: Final = frozenset({"name", "tenant_id", "logical_agent_id", "binding_id"})
_GENERATE_KEYS: Final = frozenset({"tenants", "agents", "binding_id"})


class ConfigError(ValueError):
    """The configuration is unusable; the message names the field."""


@attrs.frozen
class RouteBinding:
    """A binding the gateway runs: the name its route uses, and the identity behind it."""

    name: str
    identity: LeaseIdentity


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

    def binding(self, name: str) -> RouteBinding | None:
        """The configured binding called ``name``, if there is one."""
        return self._by_name.get(name)

    def policy(self) -> StaticConnectorPolicy:
        """This process may hold its own bindings as its own connector, never preempting
        an active holder: a survivor waits for a dead holder's lease to expire."""
        return StaticConnectorPolicy.from_dict({"rules": [{
            "tenant_id": b.identity.tenant_id, "logical_agent_id": b.identity.logical_agent_id,
            "binding_id": b.identity.binding_id, "connector_id": self.connector_id,
            "scopes": list(SCOPES), "max_lease_ttl": self.ttl,
            "max_grant_ttl": self.grant_ttl, "preempt_active": False} for b in self.bindings]})


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
    return GatewayConfig(
        connector_id, check_endpoint("endpoint", raw.get("endpoint")), checked, ttl=ttl,
        clock_step=_number(raw, "clock_step", 0.0, 0.0, 10.0),
        grant_ttl=_number(raw, "grant_ttl", min(ttl, 2.0), 0.1, min(ttl, 30.0)),
        max_hops=max_hops, forward_timeout=_number(raw, "forward_timeout", 10.0, 0.1, 60.0),
        work=work)


def load_config(path: str | None) -> GatewayConfig:
    """The configuration from ``path``, else from ``$MOS_LEASE_GATEWAY_CONFIG``."""
    if path is not None:
        return parse_config(Path(path).read_text(encoding="utf-8"))
    text = os.environ.get(ENV)
    if text is None:
        raise ConfigError(f"give --config FILE or set {ENV} to the configuration's JSON")
    return parse_config(text)
