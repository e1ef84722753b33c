"""Grants rebuilt byte for byte in another process: what a process that learned every
field of a grant, MAC included, could present. The forgery scenarios expect every one to be
refused."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from mos_lease import ExecutionGrant, LeaseIdentity
from tests.faults.recorder import ident


def grant_fields(grant: ExecutionGrant) -> dict[str, Any]:
    return {"grant_id": str(grant.grant_id), "identity": list(ident(grant.identity)),
            "connector_id": grant.connector_id, "lease_id": str(grant.lease_id),
            "epoch": grant.epoch, "scopes": list(grant.scopes),
            "expires_at": grant.expires_at.isoformat(), "correlation_id": grant.correlation_id,
            "mac": grant._mac.hex()}


def replica(fields: Mapping[str, Any]) -> ExecutionGrant:
    """A grant rebuilt field by field, MAC included, without the constructor: what a
    process that learned every byte of a grant could present."""
    grant = object.__new__(ExecutionGrant)
    values: dict[str, Any] = {
        "grant_id": UUID(fields["grant_id"]), "identity": LeaseIdentity(*fields["identity"]),
        "connector_id": fields["connector_id"], "lease_id": UUID(fields["lease_id"]),
        "epoch": fields["epoch"], "scopes": tuple(fields["scopes"]),
        "expires_at": datetime.fromisoformat(fields["expires_at"]),
        "correlation_id": fields["correlation_id"], "_mac": bytes.fromhex(fields["mac"]),
    }
    for name, value in values.items():
        object.__setattr__(grant, name, value)
    return grant


def read_dump(path: str | None) -> list[dict[str, Any]]:
    if path is None or not os.path.exists(path):
        return []
    out = []
    for line in Path(path).read_text("utf-8", "replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out
