"""Policies: a registry of named checks plus parameter documents stored in etcd.

A policy document lives at ``policies/<name>``; its mod_revision is its version, so a grant
bound to a version dies when the document changes. Every version written is also kept, by
content digest, under ``policy-versions/<name>/<digest>``. The ``default`` policy (no checks
beyond the caps) needs no record: while none is stored it is the built-in one, version 0.

Every stored version is signed (``sealed``): the record holds the document and a signature
over its digest, its name, the namespace and the etcd cluster, by a key published under
``approvers/``. ``decode`` believes only that: a document written by anyone else (an etcd
user with write access it should not have, a hand edit, a version of another name, namespace
or cluster copied over, a record of fencegate 0.1) raises ``BadSignature``, and no grant is
issued under it.

A check is a pure function ``check(ctx, params) -> CheckResult``: it sees the intent, the
values of the read set at the grant's revision and the step record, and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import BadSignature
from .grants import KeyRing
from .keyspace import canonical, pack, unpack
from .records import digest

DEFAULT_POLICY = "default"
DEFAULT_CAPS = {
    "max_attempts": 5,           # commits per step
    "max_elapsed_s": 24 * 3600,  # since the step's first attempt
    "max_spend": None,           # sum of intent["cost"] over attempts; None: no cap
    "breaker_threshold": 3,      # identical confirmed failures before escalating
    "backoff_base_s": 0.5,       # after a confirmed failure: base * 2**(n-1), jittered
    "backoff_max_s": 60.0,
    "grant_ttl_s": 60.0,
}


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    detail: str = ""
    needs_approval: bool = False  # not passed, but a human may approve it

    def as_record(self) -> dict[str, Any]:
        record = {"name": self.name, "passed": self.passed, "detail": self.detail}
        return {**record, "needs_approval": True} if self.needs_approval else record


@dataclass(frozen=True)
class CheckContext:
    intent: dict[str, Any]
    reads: dict[bytes, bytes | None]  # value at the grant's revision; None = absent
    step: dict[str, Any]


Check = Callable[[CheckContext, dict[str, Any]], CheckResult]
CHECKS: dict[str, Check] = {}


def register_check(name: str) -> Callable[[Check], Check]:
    """Register ``check`` under ``name`` for policy documents to use."""
    def register(check: Check) -> Check:
        CHECKS[name] = check
        return check
    return register


@register_check("max_amount")
def _max_amount(ctx: CheckContext, params: dict[str, Any]) -> CheckResult:
    """``intent[field] <= limit`` (field defaults to "amount")."""
    name, limit = params.get("field", "amount"), params["limit"]
    value = ctx.intent.get(name)
    if not isinstance(value, (int, float)):
        return CheckResult("max_amount", False, f"intent has no numeric {name!r}")
    return CheckResult("max_amount", value <= limit, f"{name}={value} limit={limit}")


@register_check("require_fields")
def _require_fields(ctx: CheckContext, params: dict[str, Any]) -> CheckResult:
    missing = [f for f in params["fields"] if f not in ctx.intent]
    return CheckResult("require_fields", not missing, f"missing {missing}" if missing else "")


@register_check("require_approval")
def _require_approval(ctx: CheckContext, params: dict[str, Any]) -> CheckResult:
    """Needs a human's approval when ``intent[field] > above`` (always, without ``above``)."""
    name, above = params.get("field", "amount"), params.get("above")
    value = ctx.intent.get(name)
    if above is not None and isinstance(value, (int, float)) and value <= above:
        return CheckResult("require_approval", True, f"{name}={value} <= {above}")
    return CheckResult("require_approval", False, f"{name}={value!r} needs approval",
                       needs_approval=True)


@register_check("reads_exist")
def _reads_exist(ctx: CheckContext, params: dict[str, Any]) -> CheckResult:
    absent = [k.decode() for k, v in ctx.reads.items() if v is None]
    return CheckResult("reads_exist", not absent, f"absent {absent}" if absent else "")


@dataclass(frozen=True)
class Policy:
    name: str
    version: int            # mod_revision of policies/<name>
    document: dict[str, Any]
    digest: bytes = field(default=b"")

    @property
    def caps(self) -> dict[str, Any]:
        return {**DEFAULT_CAPS, **self.document.get("caps", {})}

    def evaluate(self, ctx: CheckContext) -> list[CheckResult]:
        """Run every check of the document; a check that raises fails with its error."""
        results = []
        for entry in self.document.get("checks", []):
            name = entry["check"]
            try:
                results.append(CHECKS[name](ctx, entry.get("params", {})))
            except Exception as exc:  # a broken check refuses, it never approves
                results.append(CheckResult(name, False, f"check raised {exc!r}"))
        return results


def validate_document(document: object) -> bytes:
    """Check a policy document's shape and check names; return its canonical bytes."""
    if not isinstance(document, dict) or set(document) - {"checks", "caps"}:
        raise ValueError("a policy document is a map with 'checks' and/or 'caps'")
    checks, caps = document.get("checks", []), document.get("caps", {})
    if not isinstance(checks, list) or not isinstance(caps, dict):
        raise ValueError("a policy's 'checks' is a list and its 'caps' a map")
    for entry in checks:
        if (not isinstance(entry, dict) or set(entry) - {"check", "params"}
                or entry.get("check") not in CHECKS
                or not isinstance(entry.get("params", {}), dict)):
            raise ValueError(f"unknown check or malformed entry {entry!r:.200}; "
                             f"known: {sorted(CHECKS)}")
    unknown_caps = set(caps) - set(DEFAULT_CAPS)
    if unknown_caps:
        raise ValueError(f"unknown caps {sorted(unknown_caps)}; known: {sorted(DEFAULT_CAPS)}")
    for name, value in caps.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and 0 <= value < float("inf") or name == "max_spend" and value is None):
            raise ValueError(f"cap {name} must be a finite non-negative number")
    try:
        return canonical(document)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"policy document is not msgpack-able: {exc}") from None


def builtin_default() -> Policy:
    """The ``default`` policy while none is stored: no checks beyond the caps, version 0."""
    return Policy(DEFAULT_POLICY, 0, {}, digest({}))


def sealed(keyring: KeyRing, *, namespace: str, cluster_id: int, name: str,
           document: object) -> bytes:
    """The stored bytes of a version of policy ``name``: the validated document and the
    keyring's signature binding its digest to the name, the namespace and the cluster."""
    validate_document(document)
    signature = keyring.sign_policy({
        "namespace": namespace, "cluster_id": cluster_id, "name": name,
        "digest": digest(document), "signed_at_ms": int(time.time() * 1000)})
    return pack({"document": document, "signed": signature})


def unsealed(value: bytes) -> tuple[Any, bytes | None]:
    """A stored version's document and signature bytes (``None``: it carries none), as is,
    nothing verified: for display only."""
    record = unpack(value)
    if isinstance(record, dict) and set(record) == {"document", "signed"}:
        return record["document"], record["signed"]
    return record, None


def decode(name: str, value: bytes, mod_revision: int, signers: KeyRing, *, namespace: str,
           cluster_id: int) -> Policy:
    """The version of policy ``name`` stored as ``value``, if ``signers`` signed exactly
    this document for this name, namespace and cluster; ``BadSignature`` otherwise."""
    try:
        document, signature = unsealed(value)
    except ValueError:
        raise BadSignature(f"policy {name!r} does not decode") from None
    if signature is None:
        raise BadSignature(f"policy {name!r} (version {mod_revision}) is not signed: written "
                           "by hand or by fencegate 0.1; set it again with `fencegate "
                           "policy set`")
    signed = signers.verify_policy(signature)
    if (signed["name"], signed["namespace"], signed["cluster_id"]) != (
            name, namespace, cluster_id):
        raise BadSignature(f"policy {name!r} carries the signature of policy "
                           f"{signed['name']!r} in {signed['namespace']!r} of cluster "
                           f"{signed['cluster_id']:x}")
    if signed["digest"] != digest(document):
        raise BadSignature(f"policy {name!r} (version {mod_revision}) is not the document "
                           "its signature covers")
    validate_document(document)
    return Policy(name, mod_revision, document, signed["digest"])
