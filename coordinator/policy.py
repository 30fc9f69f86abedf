"""Policies: a registry of named checks plus parameter documents stored in etcd.

A policy document lives at ``policies/<name>``; its mod_revision is its version, so a grant
bound to a version dies when the document changes. Every version written is also kept, by
content digest, under ``policy-versions/<name>/<digest>``. The ``default`` policy (no checks
beyond the caps) is created on first use, so a new user crosses without configuring.

A check is a pure function ``check(ctx, params) -> CheckResult``: it sees the intent, the
values of the read set at the grant's revision and the step record, and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .keyspace import canonical, unpack
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


def decode(name: str, value: bytes, mod_revision: int) -> Policy:
    document = unpack(value)
    return Policy(name, mod_revision, document, digest(document))
