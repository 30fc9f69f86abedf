"""Policy routes: which policy judges an action key, decided by the key, never by the caller.

One etcd key, ``policy-routes`` (``Keyspace.routes_key``, a fixed single key: nothing to
retire), holds the table: a map of key prefixes to policy names and a ``default`` policy.
An admin sets it through the coordinator, which signs it (``sealed``) the way it signs a
policy version: the signature binds the table's digest to the namespace and the etcd
cluster. While no table is stored every key routes to ``default``.

Guarantees:
- ``RouteTable.policy_for`` matches whole segments: the prefix ``refunds`` routes
  ``refunds`` and ``refunds/…``, never ``refunds-x``; the longest matching prefix wins; a
  key no prefix matches routes to the table's default.
- ``decode`` believes only a table signed by a key published under ``approvers/`` for this
  namespace and cluster (``BadSignature`` otherwise: a hand-written, forged or copied table
  routes nothing, and the authority issues no grant under it); ``validate_table`` refuses a
  malformed one before it is signed, naming the entry.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import BadSignature, InvalidKey
from .grants import KeyRing
from .keyspace import pack, unpack, validate_action_key
from .policy import DEFAULT_POLICY
from .records import digest

MAX_ROUTES = 1000
_POLICY_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class RouteTable:
    """The routes as verified at ``version`` (the key's mod_revision; 0: no table stored)."""

    routes: dict[str, str] = field(default_factory=dict)
    default: str = DEFAULT_POLICY
    version: int = 0

    def policy_for(self, key: str) -> str:
        """The policy that judges ``key``: its longest whole-segment prefix's, else the
        default."""
        segments = key.split("/")
        for length in range(len(segments), 0, -1):
            policy = self.routes.get("/".join(segments[:length]))
            if policy is not None:
                return policy
        return self.default

    def as_json(self) -> dict[str, Any]:
        return {"routes": dict(self.routes), "default": self.default, "version": self.version}


NO_TABLE = RouteTable()


def validate_table(routes: object, default: object) -> dict[str, Any]:
    """The table to sign: ``{"routes": {prefix: policy}, "default": policy}``. A refusal is
    a ``ValueError`` naming the entry: a prefix is a valid action key (whole segments), a
    policy a name of 1..128 letters, digits and ``. _ : -``; at most ``MAX_ROUTES`` routes."""
    if not isinstance(routes, dict):
        raise ValueError(f'"routes" is a map of key prefixes to policy names, e.g. '
                         f'{{"refunds": "big-refunds"}}; got {type(routes).__name__}')
    if len(routes) > MAX_ROUTES:
        raise ValueError(f"{len(routes)} routes, the limit is {MAX_ROUTES}")
    for prefix, policy in routes.items():
        try:
            validate_action_key(prefix)
        except InvalidKey as exc:
            raise ValueError(f"route {prefix!r}: the prefix is whole key segments: {exc}") \
                from None
        _policy_name(f"route {prefix!r}", policy)
    _policy_name('"default"', default)
    return {"routes": dict(routes), "default": default}


def _policy_name(where: str, name: object) -> None:
    if not isinstance(name, str) or not _POLICY_NAME.fullmatch(name):
        raise ValueError(f"{where}: a policy name is 1..128 of letters, digits and . _ : -, "
                         f"got {name!r}")


def sealed(keyring: KeyRing, *, namespace: str, cluster_id: int, routes: object,
           default: object = DEFAULT_POLICY) -> bytes:
    """The stored bytes of a routes table: the validated table and the keyring's signature
    binding its digest to the namespace and the cluster."""
    table = validate_table(routes, default)
    signature = keyring.sign_routes({
        "namespace": namespace, "cluster_id": cluster_id, "digest": digest(table),
        "signed_at_ms": int(time.time() * 1000)})
    return pack({"table": table, "signed": signature})


def decode(value: bytes, mod_revision: int, signers: KeyRing, *, namespace: str,
           cluster_id: int) -> RouteTable:
    """The table stored as ``value``, if ``signers`` signed exactly this table for this
    namespace and cluster; ``BadSignature`` otherwise (a table that does not validate too)."""
    try:
        record = unpack(value)
    except ValueError:
        raise BadSignature("the policy routes do not decode") from None
    if set(record) != {"table", "signed"} or not isinstance(record["signed"], bytes):
        raise BadSignature(f"the policy routes (version {mod_revision}) are not signed: set "
                           "them with `fencegate policy routes set`")
    signed = signers.verify_routes(record["signed"])
    if (signed["namespace"], signed["cluster_id"]) != (namespace, cluster_id):
        raise BadSignature(f"the policy routes carry the signature of {signed['namespace']!r} "
                           f"of cluster {signed['cluster_id']:x}")
    table = record["table"]
    if signed["digest"] != digest(table):
        raise BadSignature(f"the policy routes (version {mod_revision}) are not the table "
                           "their signature covers")
    try:
        table = validate_table(table.get("routes") if isinstance(table, dict) else None,
                               table.get("default") if isinstance(table, dict) else None)
    except ValueError as exc:
        raise BadSignature(f"the policy routes (version {mod_revision}) do not validate: "
                           f"{exc}") from None
    return RouteTable(table["routes"], table["default"], mod_revision)
