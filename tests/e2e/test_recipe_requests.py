"""The HTTP gateway recipes' pure parts, without a server: the configuration, the screen
every request passes (no caller-controlled identity reaches the library), the routing
decision and the forward to a holder that does not answer."""

from __future__ import annotations

import json
import re
import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from examples.recipes.config import (
    ENV,
    MAX_BINDINGS,
    MAX_CONFIG_BYTES,
    ConfigError,
    load_config,
    parse_config,
)
from examples.recipes.forward import forward
from examples.recipes.routing import Forward, Serve, route
from examples.recipes.screen import HOPS_HEADER, MAX_BODY_BYTES, Refusal, Work, screen
from mos_lease import ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.fleet import FLEET_TENANT, member_identity
from mos_lease.results import HolderView
from mos_lease.vocabulary import LeaseState, Reason
from mos_lease_memory import InMemoryLeaseStore

pytestmark = pytest.mark.e2e

BINDING = {"name": "ledger", "tenant_id": "acme", "logical_agent_id": "agent-1",
           "binding_id": "ledger"}
GOOD: dict[str, Any] = {"connector_id": "gw-a", "endpoint": "http://127.0.0.1:8001",
                        "bindings": [BINDING]}
CONFIG = parse_config(json.dumps(GOOD))
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_configuration_names_each_binding_and_its_identity() -> None:
    ledger = CONFIG.binding("ledger")
    assert ledger is not None and ledger.identity == LeaseIdentity("acme", "agent-1", "ledger")
    assert CONFIG.binding("acme") is None
    assert (CONFIG.host, CONFIG.port, CONFIG.metadata) == (
        "127.0.0.1", 8001, {"endpoint": "http://127.0.0.1:8001"})
    assert (CONFIG.ttl, CONFIG.clock_step, CONFIG.grant_ttl, CONFIG.max_hops) == (3, 0, 2, 2)


@pytest.mark.parametrize(("change", "names"), [
    ({"bindings": []}, "bindings"),
    ({"bindings": "ledger"}, "bindings"),
    ({"bindings": [BINDING, BINDING]}, "same name"),
    ({"bindings": [BINDING, {**BINDING, "name": "other"}]}, "same identity"),
    ({"bindings": [{**BINDING, "name": "Ledger!"}]}, "bindings[0].name"),
    ({"bindings": [{**BINDING, "tenant_id": ""}]}, "bindings[0]"),
    ({"bindings": [{**BINDING, "tenant_id": 7}]}, "bindings[0]"),
    ({"bindings": [{**BINDING, "extra": "x"}]}, "bindings[0]"),
    ({"endpoint": "https://127.0.0.1:8001"}, "endpoint"),
    ({"endpoint": "http://127.0.0.1"}, "endpoint"),
    ({"endpoint": "http://127.0.0.1:8001/x"}, "endpoint"),
    ({"endpoint": "http://127.0.0.1:99999"}, "endpoint"),
    ({"endpoint": 8001}, "endpoint"),
    ({"connector_id": ""}, "connector_id"),
    ({"ttl": 0.5}, "ttl"),
    ({"ttl": True}, "ttl"),
    ({"ttl": "3"}, "ttl"),
    ({"max_hops": 9}, "max_hops"),
    ({"grant_ttl": 10}, "grant_ttl"),
    ({"tenant_id": "acme"}, "unknown keys"),
    ({"work": "echo"}, "work"),
    ({"generate": {"tenants": 2, "agents": 2}}, "generate"),
    ({"generate": {"tenants": 0, "agents": 2, "binding_id": "main"}}, "generate"),
    ({"generate": {"tenants": True, "agents": 2, "binding_id": "main"}}, "generate"),
    ({"generate": {"tenants": 101, "agents": 100, "binding_id": "main"}}, "generate"),
    ({"generate": {"tenants": 1, "agents": 1, "binding_id": ""}}, "generate.binding_id"),
    ({"generate": {"tenants": 1, "agents": 1, "binding_id": "ledger"}, "bindings": [
        {**BINDING, "name": "t0-a0"}]}, "same name"),
])
def test_a_bad_configuration_is_refused_naming_the_field(change: dict[str, Any],
                                                         names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace("]", r"\]")):
        parse_config(json.dumps({**GOOD, **change}))


def test_a_gateway_of_thousands_of_bindings_generates_them() -> None:
    """``generate`` adds a binding per tenant and agent, beside the listed ones; the policy
    names each, and a name is found without a scan."""
    config = parse_config(json.dumps({**GOOD, "work": "validate", "generate": {
        "tenants": 20, "agents": 499, "binding_id": "main"}}))
    assert len(config.bindings) == 9_981 and config.work == "validate"
    found = config.binding("t19-a498")
    assert found is not None and found.identity == LeaseIdentity("tenant-19", "agent-498",
                                                                 "main")
    assert config.binding("t20-a0") is None and config.binding("ledger") is not None
    assert len(config.policy().rules) == 9_981
    only = parse_config(json.dumps({"connector_id": "gw-a", "endpoint": GOOD["endpoint"],
                                    "generate": {"tenants": 1, "agents": 2,
                                                 "binding_id": "b"}}))
    assert [b.name for b in only.bindings] == ["t0-a0", "t0-a1"] and only.work == "ledger"
    with pytest.raises(ConfigError, match="10000 bindings in all"):
        parse_config(json.dumps({**GOOD, "generate": {"tenants": 100, "agents": 100,
                                                      "binding_id": "main"}}))


@pytest.mark.parametrize("text", ["", "[]", "{", "x" * (MAX_CONFIG_BYTES + 1)])
def test_a_configuration_that_is_no_json_object_is_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_config(text)


def test_a_file_may_list_every_binding_a_gateway_may_run() -> None:
    """The most bindings, each at the longest name and ids, indented as an editor saves
    them, fit in a file; one byte over the bound is refused before it is parsed."""
    listed = [{"name": f"{n:064d}", "tenant_id": f"{n:0128d}", "logical_agent_id": "a" * 128,
               "binding_id": "b" * 128} for n in range(MAX_BINDINGS)]
    text = json.dumps({**GOOD, "bindings": listed}, indent=4)
    config = parse_config(text)
    assert len(config.bindings) == MAX_BINDINGS == len(config.policy().rules)
    assert config.binding(f"{MAX_BINDINGS - 1:064d}") is not None
    with pytest.raises(ConfigError, match="over"):
        parse_config(text + " " * (MAX_CONFIG_BYTES + 1 - len(text.encode())))


FLEET = {"name": "edge", "members": ["gw-a", "gw-b", "gw-c"]}


def test_a_gateway_joins_its_fleet_as_its_connector_with_its_endpoint() -> None:
    config = parse_config(json.dumps({**GOOD, "ttl": 5, "fleet": {
        **FLEET, "look": 0.5, "grace": 3, "weight": 2}}))
    fleet = config.join()
    assert fleet is not None and CONFIG.join() is None
    assert (fleet.name, fleet.member, fleet.members, fleet.endpoint, fleet.weight,
            fleet.ttl, fleet.look, fleet.grace) == (
        "edge", "gw-a", ("gw-a", "gw-b", "gw-c"), GOOD["endpoint"], 2.0, 5.0, 0.5,
        timedelta(seconds=3))
    # The policy lets the process hold its own member lease, and no other member's.
    gateway = ConnectorLeaseCoordinator(InMemoryLeaseStore(), config.policy())
    assert gateway.acquire(member_identity("edge", "gw-a"), "gw-a", scopes=[], ttl=5).ok
    assert gateway.acquire(member_identity("edge", "gw-b"), "gw-a", scopes=[],
                           ttl=5).reason is Reason.POLICY_DENIED
    assert gateway.acquire(member_identity("edge", "gw-a"), "gw-b", scopes=[],
                           ttl=5).reason is Reason.POLICY_DENIED


@pytest.mark.parametrize(("fleet", "names"), [
    ("edge", "fleet"),
    ({"name": "edge"}, "fleet"),
    ({**FLEET, "member": "gw-a"}, "fleet"),
    ({**FLEET, "members": "gw-a"}, "fleet.members"),
    ({**FLEET, "members": ["gw-b", "gw-c"]}, "fleet.members"),
    ({**FLEET, "members": ["gw-a", "gw-a"]}, "fleet.members"),
    ({**FLEET, "name": ""}, "fleet.name"),
    ({**FLEET, "name": 7}, "fleet.name"),
    ({**FLEET, "members": [1, "gw-a"]}, "fleet.members"),
    ({**FLEET, "look": 0}, "fleet.look"),
    ({**FLEET, "look": True}, "fleet.look"),
    ({**FLEET, "grace": "1"}, "fleet.grace"),
    ({**FLEET, "grace": -1}, "fleet.grace"),
    ({**FLEET, "weight": 0}, "fleet.weight"),
])
def test_a_bad_fleet_is_refused_naming_the_field(fleet: object, names: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(names)}"):
        parse_config(json.dumps({**GOOD, "ttl": 5, "fleet": fleet}))


def test_a_fleet_needs_a_ttl_its_member_lease_can_keep() -> None:
    """The member lease keeps the library's default margin (a step of the database's clock
    covered), whatever ``clock_step`` the bindings use: the recipe's default ttl is too short,
    refused when the configuration is read, not when the process starts."""
    with pytest.raises(ConfigError, match=r"^ttl: too short for a fleet.s member lease"):
        parse_config(json.dumps({**GOOD, "fleet": FLEET}))
    assert parse_config(json.dumps({**GOOD, "ttl": 4, "fleet": FLEET})).join() is not None


def test_no_binding_may_use_the_tenant_of_the_member_leases() -> None:
    with pytest.raises(ConfigError, match=r"bindings\[0\].tenant_id: 'mos-lease.fleet'"):
        parse_config(json.dumps({**GOOD, "bindings": [{**BINDING, "tenant_id": FLEET_TENANT}]}))


def test_the_configuration_comes_from_a_file_or_the_environment(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gw.json"
    path.write_text(json.dumps(GOOD))
    assert load_config(str(path)) == CONFIG
    monkeypatch.setenv(ENV, json.dumps(GOOD))
    assert load_config(None) == CONFIG
    monkeypatch.delenv(ENV)
    with pytest.raises(ConfigError, match=ENV):
        load_config(None)


def reason(query: str = "", headers: list[tuple[str, str]] | None = None,
           body: bytes = b'{"text": "hi"}') -> str | Work:
    screened = screen(query, headers or [], body)
    return screened.reason if isinstance(screened, Refusal) else screened


@pytest.mark.parametrize("header", [
    "X-Tenant-Id", "x-tenant-id", "Tenant", "TENANT_ID", "X-Logical-Agent-Id", "Agent-Id",
    "X-Binding-Id", "Binding", "X-Connector-Id", "X-Epoch", "X-Lease-Id",
    "X-Mos-Lease-Tenant-Id"])
def test_a_header_naming_an_identity_is_refused(header: str) -> None:
    assert reason(headers=[("User-Agent", "curl"), (header, "other")]) == "caller_identity"


# Names that say "tenant", "agent", "binding", "connector", "lease" or "epoch" with a prefix
# or a suffix of their own: refused by what they mean, not by a list of spellings.
MEANING_HEADERS = ["X-Tenant-Name", "X-Lease-Epoch", "X-Agent-Name", "X-Mos-Lease-Agent-Id",
                   "X-Mos-Lease-Epoch", "X-Connector-Name", "X-Binding-Name"]
MEANING_KEYS = ["tenantName", "lease_epoch", "agentName", "mosLeaseEpoch", "connector-name",
                "bindingName", "X-Lease-Epoch", "tenants", "identities", "logicalAgent",
                "agent2", "x-tenantname", "leaseholder", HOPS_HEADER,
                "\uff54\uff45\uff4e\uff41\uff4e\uff54_id",  # fullwidth letters (NFKC)
                "lea\u017fe"]  # a long s, which case-folds to "s"


def as_servers_hand_it_over(header: str) -> list[str]:
    """``header`` as the ASGI recipe sees it (lower-cased) and as the WSGI one does
    (``HTTP_X_TENANT_NAME`` in the environ, turned back into ``X-TENANT-NAME``)."""
    return [header, header.lower(), header.upper().replace("_", "-")]


@pytest.mark.parametrize("header", MEANING_HEADERS)
def test_a_header_meaning_an_identity_is_refused_in_any_spelling(header: str) -> None:
    for spelled in as_servers_hand_it_over(header):
        assert reason(headers=[("User-Agent", "curl"), (spelled, "other")]) == (
            "caller_identity"), spelled


@pytest.mark.parametrize("key", MEANING_KEYS)
def test_a_query_key_or_body_field_meaning_an_identity_is_refused(key: str) -> None:
    assert reason(query=f"{key}=other") == "caller_identity"
    assert reason(body=json.dumps({"text": "hi", key: "other"}).encode()) == "caller_identity"


def test_the_hop_count_and_the_user_agent_are_the_only_headers_exempted_whole() -> None:
    # Both contain a word ("lease", "agent") but name no identity: taken as they are...
    assert reason(headers=[("User-Agent", "agent/1"), (HOPS_HEADER, "1")]) == Work("hi", 1)
    assert reason(headers=[("USER-AGENT", "x"), ("x-mos-lease-hops", "1")]) == Work("hi", 1)
    # ...and in no other spelling, nor anywhere but the headers.
    for header in ["X-Mos-Lease-Hop", "X_Mos_Lease_Hops", "X-Mos-Lease-Hops-2", "Agent",
                   "User-Agent-Id", "X-User-Agent", "UserAgent"]:
        assert reason(headers=[(header, "1")]) == "caller_identity", header
    assert reason(query="x-mos-lease-hops=1") == "caller_identity"
    assert reason(body=b'{"text": "hi", "User-Agent": "x"}') == "caller_identity"


@pytest.mark.parametrize("header", [
    "Accept", "Accept-Encoding", "Accept-Language", "Authorization", "Cache-Control",
    "Connection", "Content-Length", "Content-Type", "Cookie", "Forwarded", "Host", "Origin",
    "Referer", "Traceparent", "Tracestate", "Baggage", "X-Request-Id", "X-Correlation-Id",
    "X-Forwarded-For", "X-Forwarded-Proto", "X-Real-IP", "X-Amzn-Trace-Id", "X-B3-TraceId",
    "Sec-CH-UA-Platform", "Sec-Fetch-Mode", "Idempotency-Key", "X-Api-Key", "Priority"])
def test_the_headers_clients_and_proxies_send_pass(header: str) -> None:
    for spelled in as_servers_hand_it_over(header):
        assert reason(headers=[(spelled, "v")]) == Work("hi", 0), spelled


# Every spelling Hypothesis makes of an identity word: plurals, any case, any prefix and
# suffix tokens, joined by separators, digits or nothing (camelCase and glued).
WORDS = ["tenant", "tenants", "agent", "agents", "logical", "bind", "binding", "bindings",
         "connector", "connectors", "identity", "identities", "lease", "leases", "epoch",
         "epochs"]
# Tokens that contain no identity word, alone or glued to each other ("user" and "hop" are
# here so that names close to the two exempt headers are made too).
PLAIN = ["x", "mos", "id", "name", "ref", "key", "my", "request", "trace", "client", "user",
         "hop", "count", "session", "version", "v1", "2", "api", "token", "page"]
SEPARATORS = ["-", "_", "", ".", "0", "42"]


def spelled(draw: st.DrawFn, middle: list[str]) -> str:
    prefix = draw(st.lists(st.sampled_from(PLAIN), max_size=3))
    suffix = draw(st.lists(st.sampled_from(PLAIN), max_size=3))
    separator = draw(st.sampled_from(SEPARATORS))
    parts = [*prefix, *middle, *suffix]
    style = draw(st.sampled_from(["lower", "upper", "title", "camel", "random"]))
    if style == "upper":
        parts = [part.upper() for part in parts]
    elif style == "title" or (style == "camel" and separator == ""):
        parts = [part.title() for part in parts]
    elif style == "random":
        parts = ["".join(c.upper() if draw(st.booleans()) else c for c in part)
                 for part in parts]
    name = separator.join(parts)
    return name[0].lower() + name[1:] if style == "camel" else name


@st.composite
def identity_names(draw: st.DrawFn) -> str:
    return spelled(draw, [draw(st.sampled_from(WORDS))])


@st.composite
def plain_names(draw: st.DrawFn) -> str:
    return spelled(draw, draw(st.lists(st.sampled_from(PLAIN), min_size=1, max_size=3)))


@given(identity_names())
def test_every_spelling_of_an_identity_word_is_refused_everywhere(name: str) -> None:
    for header in as_servers_hand_it_over(name):
        assert reason(headers=[(header, "other")]) == "caller_identity", header
    assert reason(query=f"{name}=other") == "caller_identity"
    assert reason(body=json.dumps({"text": "hi", name: "other"}).encode()) == (
        "caller_identity")


@given(plain_names())
def test_a_name_without_an_identity_word_is_no_identity(name: str) -> None:
    # As a header it is neither read nor refused; in the query or the body it is still
    # refused, by the allow-list, with its own reason.
    for header in as_servers_hand_it_over(name):
        assert reason(headers=[(header, "v")]) == Work("hi", 0), header
    assert reason(query=f"{name}=v") == "unexpected_query"
    assert reason(body=json.dumps({"text": "hi", name: "v"}).encode()) == "unknown_field"


@pytest.mark.parametrize("query", ["tenant_id=other", "agent=a", "x-binding-id=b",
                                   "text=hi&logical_agent_id=a", "connector_id="])
def test_a_query_parameter_naming_an_identity_is_refused(query: str) -> None:
    assert reason(query=query) == "caller_identity"


@pytest.mark.parametrize("fields", [{"tenant_id": "other"}, {"logical_agent_id": "a"},
                                    {"binding_id": "b"}, {"connector_id": "c"},
                                    {"epoch": 9}, {"Tenant-Id": "x"}])
def test_a_body_field_naming_an_identity_is_refused_before_any_other_fault(
        fields: dict[str, Any]) -> None:
    # Even with the text missing, the identity is what the refusal names.
    assert reason(body=json.dumps(fields).encode()) == "caller_identity"
    assert reason(body=json.dumps({"text": "hi", **fields}).encode()) == "caller_identity"


@pytest.mark.parametrize(("body", "expected"), [
    (b"", "invalid_body"), (b"[1]", "invalid_body"), (b'"text"', "invalid_body"),
    (b"\xff\xfe", "invalid_body"), (b"[" * 10_000, "invalid_body"),
    (b'{"text": 1}', "invalid_text"), (b'{"text": ""}', "invalid_text"),
    (b'{"text": null}', "invalid_text"), (b"{}", "invalid_text"),
    (json.dumps({"text": "x" * 1001}).encode(), "invalid_text"),
    (b'{"text": "hi", "note": 1}', "unknown_field"),
    (b"x" * (MAX_BODY_BYTES + 1), "body_too_large"),
])
def test_a_malformed_body_is_refused(body: bytes, expected: str) -> None:
    assert reason(body=body) == expected


def test_only_an_empty_query_and_one_hop_count_are_taken() -> None:
    assert reason(query="page=2") == "unexpected_query"
    for hops in ["-1", "²", "9", "1.0", "", "01x"]:
        assert reason(headers=[("X-Mos-Lease-Hops", hops)]) == "invalid_hops", hops
    assert reason(headers=[("X-Mos-Lease-Hops", "1"),
                           ("x-mos-lease-hops", "1")]) == "invalid_hops"
    assert reason(headers=[("x-mos-lease-hops", "2"), ("User-Agent", "agent/1")]) == Work(
        "hi", 2)
    assert Work("hi", 2).forward_body() == b'{"text": "hi"}'


def holder(connector: str = "gw-b", state: LeaseState = LeaseState.ACTIVE,
           metadata: dict[str, str] | None = None) -> HolderView:
    return HolderView(connector, 3, state, NOW + timedelta(seconds=3), NOW,
                      metadata if metadata is not None
                      else {"endpoint": "http://127.0.0.1:8002"})


def test_a_request_is_served_here_forwarded_to_the_holder_or_refused() -> None:
    def decided(**kw: Any) -> object:
        where = route(CONFIG, held=kw.pop("held", False), holder=kw.pop("holder", None),
                      hops=kw.pop("hops", 0))
        return where.reason if isinstance(where, Refusal) else where

    assert decided(held=True, holder=holder()) == Serve()
    assert decided(holder=holder()) == Forward("http://127.0.0.1:8002", 1)
    assert decided(holder=holder(), hops=1) == Forward("http://127.0.0.1:8002", 2)
    assert decided(holder=holder(), hops=2) == "hop_limit"
    assert decided() == "no_holder"
    assert decided(holder=holder(state=LeaseState.EXPIRED)) == "no_holder"
    assert decided(holder=holder(state=LeaseState.RELEASED)) == "no_holder"
    assert decided(holder=holder(connector="gw-a")) == "not_held_here"
    assert decided(holder=holder(metadata={})) == "holder_without_endpoint"
    assert decided(holder=holder(metadata={"endpoint": "file:///etc"})) == (
        "holder_without_endpoint")
    assert decided(holder=holder(metadata={"endpoint": CONFIG.endpoint})) == "not_held_here"


def test_a_holder_that_does_not_answer_is_a_503() -> None:
    with socket.socket() as sock:  # a port nothing listens on once it is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    refused = forward(f"http://127.0.0.1:{port}", "ledger", Work("hi", 0), 1, timeout=5)
    assert isinstance(refused, Refusal)
    assert (refused.status, refused.reason) == (503, "holder_unreachable")
