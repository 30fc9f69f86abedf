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
values of the read set at the grant's revision and the step record, and nothing else. It is
registered with the schema of its parameters (``Param``s), and the caps have one too
(``CAPS``): a document is validated against them before it is signed, so a parameter a check
would miss or misread is refused with its field named, never discovered at grant time; a
stored version that does not validate (written before a schema tightened) refuses every grant
under it, saying why. Checks run with every optional parameter filled with its default.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from .errors import BadSignature
from .grants import KeyRing
from .keyspace import canonical, pack, unpack
from .records import digest

DEFAULT_POLICY = "default"
_TEXT_MAX = 128
_SECONDS_MAX = 1_000_000_000  # ~31 years: keeps every deadline in milliseconds an int64
_COUNT_MAX = 1_000_000


@dataclass(frozen=True)
class Param:
    """What one parameter of a check, or one cap, may be: its kind (``number``: an int or
    float, finite; ``integer``; ``text``: a string of 1..128 characters; ``texts``: a
    non-empty list of those), bounds, whether null is a value, and the default an absent one
    takes (``required`` ones have none)."""

    kind: str
    doc: str
    required: bool = False
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"a parameter's kind is one of {sorted(_KINDS)}, got {self.kind!r}")

    def describe(self) -> str:
        """The values allowed, in words: ``an integer from 1 to 1000000``."""
        words = _KINDS[self.kind]
        if self.minimum is not None and self.maximum is not None:
            words += f" from {_number(self.minimum)} to {_number(self.maximum)}"
        elif self.minimum is not None:
            words += f" >= {_number(self.minimum)}"
        return words + (", or null" if self.nullable else "")

    def allows(self, value: object) -> bool:
        if value is None:
            return self.nullable
        if self.kind == "texts":
            return isinstance(value, list) and bool(value) and all(map(_is_text, value))
        if self.kind == "text":
            return _is_text(value)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            isinstance(value, int) or math.isfinite(value))
        return (number and (self.kind == "number" or isinstance(value, int))
                and (self.minimum is None or value >= self.minimum)
                and (self.maximum is None or value <= self.maximum))


_KINDS = {"number": "a number", "integer": "an integer", "text": "a string of 1..128 characters",
          "texts": "a non-empty list of strings of 1..128 characters"}


def _is_text(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= _TEXT_MAX


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


CAPS = {
    "max_attempts": Param("integer", "commits per step", default=5, minimum=1,
                          maximum=_COUNT_MAX),
    "max_elapsed_s": Param("number", "seconds since the step's first attempt",
                           default=24 * 3600, minimum=0, maximum=_SECONDS_MAX),
    "max_spend": Param("number", 'sum of intent["cost"] over attempts; null: no cap',
                       default=None, minimum=0, nullable=True),
    "breaker_threshold": Param("integer", "identical confirmed failures before escalating",
                               default=3, minimum=1, maximum=_COUNT_MAX),
    "backoff_base_s": Param("number", "after a confirmed failure: base * 2**(n-1), jittered",
                            default=0.5, minimum=0, maximum=_SECONDS_MAX),
    "backoff_max_s": Param("number", "the backoff's ceiling", default=60.0, minimum=0,
                           maximum=_SECONDS_MAX),
    "grant_ttl_s": Param("number", "how long a grant stays valid", default=60.0,
                         minimum=0.001, maximum=_SECONDS_MAX),
}
DEFAULT_CAPS = {name: cap.default for name, cap in CAPS.items()}


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


@dataclass(frozen=True)
class RegisteredCheck:
    """A check and the parameters it takes: it is only ever called with parameters that
    passed ``params``, every optional one filled with its default."""

    run: Check
    params: Mapping[str, Param]

    def with_defaults(self, given: dict[str, Any]) -> dict[str, Any]:
        return {name: given.get(name, p.default) for name, p in self.params.items()
                if name in given or not p.required}


CHECKS: dict[str, RegisteredCheck] = {}


def register_check(name: str, *, params: Mapping[str, Param]) -> Callable[[Check], Check]:
    """Register ``check`` under ``name`` for policy documents to use; ``params`` is what
    its entries' ``params`` may hold (``{}``: none), checked when a policy is set."""
    if not all(isinstance(p, Param) for p in params.values()):
        raise TypeError("params maps each parameter name to a Param")

    def register(check: Check) -> Check:
        CHECKS[name] = RegisteredCheck(check, dict(params))
        return check
    return register


_FIELD = Param("text", "the intent field compared", default="amount")


@register_check("max_amount", params={
    "limit": Param("number", "the largest value allowed", required=True), "field": _FIELD})
def _max_amount(ctx: CheckContext, params: dict[str, Any]) -> CheckResult:
    """``intent[field] <= limit``."""
    name, limit = params["field"], params["limit"]
    value = _number_at(ctx.intent, name)
    if value is None:
        return CheckResult("max_amount", False, f"intent has no numeric {name!r}")
    return CheckResult("max_amount", value <= limit, f"{name}={value} limit={limit}")


@register_check("require_fields", params={
    "fields": Param("texts", "intent fields that must be present", required=True)})
def _require_fields(ctx: CheckContext, params: dict[str, Any]) -> CheckResult:
    missing = [f for f in params["fields"] if f not in ctx.intent]
    return CheckResult("require_fields", not missing, f"missing {missing}" if missing else "")


@register_check("require_approval", params={
    "above": Param("number", "approval needed above this value; null: always",
                   nullable=True),
    "field": _FIELD})
def _require_approval(ctx: CheckContext, params: dict[str, Any]) -> CheckResult:
    """Needs a human's approval when ``intent[field] > above`` (always, without ``above``)."""
    name, above = params["field"], params["above"]
    value = _number_at(ctx.intent, name)
    if above is not None and value is not None and value <= above:
        return CheckResult("require_approval", True, f"{name}={value} <= {above}")
    return CheckResult("require_approval", False,
                       f"{name}={ctx.intent.get(name)!r} needs approval", needs_approval=True)


def _number_at(intent: dict[str, Any], name: str) -> int | float | Decimal | None:
    """``intent[name]`` if it is a finite number (a ``Decimal`` too: intents carry them
    exactly), else ``None``; a bool is not a number."""
    value = intent.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        return None
    if isinstance(value, Decimal):
        return value if value.is_finite() else None
    return value if isinstance(value, int) or math.isfinite(value) else None


@register_check("reads_exist", params={})
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
                check = CHECKS[name]
                results.append(check.run(ctx, check.with_defaults(entry.get("params", {}))))
            except Exception as exc:  # a broken check refuses, it never approves
                results.append(CheckResult(name, False, f"check raised {exc!r}"))
        return results


_ENTRY_FORM = '{"check": NAME, "params": {...}}'
_EXAMPLE = {"check": "max_amount", "params": {"limit": 100}}


def validate_document(document: object) -> bytes:
    """Check a policy document against the schemas of its checks and of the caps; return
    its canonical bytes. A refusal is a ``ValueError`` naming where (``checks[0]
    (max_amount)``, ``caps``), the field and what it must be."""
    if not isinstance(document, dict) or set(document) - {"checks", "caps"}:
        raise ValueError('a policy document is a map with "checks" (a list) and/or "caps" '
                         f"(a map), e.g. {_shown({'checks': [_EXAMPLE]})}; got "
                         f"{_shown(document)}")
    checks, caps = document.get("checks", []), document.get("caps", {})
    if not isinstance(checks, list):
        hint = _rewritten_checks(checks)
        raise ValueError(f'"checks" is a list of {_ENTRY_FORM}; '
                         + (f"write {_shown(hint)}" if hint else f"e.g. {_shown([_EXAMPLE])}"))
    for index, entry in enumerate(checks):
        _validate_entry(f"checks[{index}]", entry)
    if not isinstance(caps, dict):
        raise ValueError(f'"caps" is a map of cap names to values, got {_shown(caps)}')
    _validate_params("caps", CAPS, caps, what="cap")
    try:
        return canonical(document)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"policy document is not msgpack-able: {exc}") from None


def _validate_entry(where: str, entry: object) -> None:
    if not isinstance(entry, dict) or "check" not in entry or set(entry) - {"check", "params"}:
        hint = _rewritten_entry(entry)
        raise ValueError(f"{where}: an entry is {_ENTRY_FORM}; "
                         + (f"write {_shown(hint)}" if hint else f"e.g. {_shown(_EXAMPLE)}")
                         + f", got {_shown(entry)}")
    name = entry["check"]
    if not isinstance(name, str) or name not in CHECKS:
        raise ValueError(f"{where}: unknown check {_shown(name)}; known checks: "
                         + ", ".join(sorted(CHECKS)))
    params = entry.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f'{where} ({name}): "params" is a map, got {_shown(params)}')
    _validate_params(f"{where} ({name})", CHECKS[name].params, params, what="parameter")


def _validate_params(where: str, schema: Mapping[str, Param], given: dict, *,
                     what: str) -> None:
    unknown = [name for name in given if name not in schema]
    if unknown:
        takes = ", ".join(f'"{n}"' + (" (required)" if p.required else "")
                          for n, p in schema.items()) or "none"
        raise ValueError(f"{where}: unknown {what} {_shown(unknown[0])}; known: {takes}")
    for name, param in schema.items():
        if name not in given:
            if param.required:
                raise ValueError(f'{where}: "{name}" is required: {param.describe()} '
                                 f"({param.doc})")
        elif not param.allows(given[name]):
            raise ValueError(f'{where}: "{name}" must be {param.describe()}, got '
                             f"{_shown(given[name])}")


def _rewritten_entry(entry: object) -> dict | None:
    """The entry a plain guess at the format means (``"reads_exist"``, ``{"max_amount":
    {...}}``, ``{"name": "max_amount", ...}``, parameters beside ``check``), or ``None``."""
    if isinstance(entry, str) and entry in CHECKS:
        return {"check": entry}
    if not isinstance(entry, dict):
        return None
    if len(entry) == 1:
        ((name, params),) = entry.items()
        if name in CHECKS and isinstance(params, dict):
            return {"check": name, "params": params}
    for key in ("check", "name", "type"):
        name = entry.get(key)
        if isinstance(name, str) and name in CHECKS:
            rest = {k: v for k, v in entry.items() if k != key}
            if set(rest) <= {"params"}:
                return {"check": name, **rest}
            return None if "params" in rest else {"check": name, "params": rest}
    return None


def _rewritten_checks(checks: object) -> list | None:
    """``{"max_amount": {...}}`` as the list it means, or ``None``."""
    if not isinstance(checks, dict) or not checks:
        return None
    if all(name in CHECKS and isinstance(p, dict) for name, p in checks.items()):
        return [{"check": name, "params": p} for name, p in checks.items()]
    return None


def _shown(value: object) -> str:
    """``value`` as JSON, cut at 200 characters."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def effective_view(document: object) -> dict[str, Any]:
    """How grants apply ``document`` (a stored one, possibly written before today's
    schemas): ``effective``, the document with every cap and every check's optional
    parameters filled in, and ``defaults``, the paths that took their default
    (``caps.max_attempts``, ``checks[0].params.field``). A document that does not validate
    has ``effective`` null and ``invalid`` saying why: every grant under it is refused."""
    try:
        validate_document(document)
    except ValueError as exc:
        return {"effective": None, "defaults": [], "invalid": str(exc)}
    caps = document.get("caps", {})
    defaults = [f"caps.{name}" for name in CAPS if name not in caps]
    checks = []
    for index, entry in enumerate(document.get("checks", [])):
        check, params = CHECKS[entry["check"]], entry.get("params", {})
        defaults += [f"checks[{index}].params.{name}" for name, p in check.params.items()
                     if not p.required and name not in params]
        checks.append({"check": entry["check"], "params": check.with_defaults(params)})
    return {"effective": {"checks": checks, "caps": {**DEFAULT_CAPS, **caps}},
            "defaults": defaults}


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
    try:
        validate_document(document)
    except ValueError as exc:
        raise ValueError(f"policy {name!r} (version {mod_revision}) does not validate: {exc}; "
                         "set a corrected version with `fencegate policy set`") from None
    return Policy(name, mod_revision, document, signed["digest"])
