"""The HTTP gateway recipes' pure parts, without a server: the configuration, the screen
every request passes (no caller-controlled identity reaches the library), the routing
decision and the forward to a holder that does not answer."""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from examples.recipes.config import ENV, ConfigError, load_config, parse_config
from examples.recipes.forward import forward
from examples.recipes.routing import Forward, Serve, route
from examples.recipes.screen import MAX_BODY_BYTES, Refusal, Work, screen
from mos_lease import LeaseIdentity
from mos_lease.results import HolderView
from mos_lease.vocabulary import LeaseState

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
])
def test_a_bad_configuration_is_refused_naming_the_field(change: dict[str, Any],
                                                         names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace("]", r"\]")):
        parse_config(json.dumps({**GOOD, **change}))


@pytest.mark.parametrize("text", ["", "[]", "{", "x" * (64 * 1024 + 1)])
def test_a_configuration_that_is_no_json_object_is_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_config(text)


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
