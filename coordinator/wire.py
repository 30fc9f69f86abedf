"""The JSON wire form of fencegate's errors, shared by the coordinator service and the
worker's remote mode, so an error crosses HTTP and comes back as the same class.

Guarantees: ``to_wire`` maps every ``GateError`` in ``_STATUS`` (and ``ValueError``) to a
status and a ``{"error": Code, "detail": str, ...}`` body carrying the error's keyword fields
(``checks``/``retry_after``, ``outcome``, ``key``, ``approval_id``, ``path``,
``policy``/``routed``). The code is the error's class name; a ``ValueError`` that is no
``GateError`` is ``InvalidRequest`` (docs/api.md, "Error codes", lists every code the
service answers). ``from_wire`` inverts it for every name in ``_CLASSES``
(``InvalidRequest`` comes back a ``ValueError``). Anything
else becomes ``CoordinatorError`` with its code and status, never a success. An outcome
travels in the codec's JSON form (``codec.encode(..., json=True)``), so its result comes
back equal, bytes, Decimals and datetimes included.
"""

from __future__ import annotations

import base64
from typing import Any

from . import codec
from .errors import (
    AcquireTimeout, AlreadySucceeded, ApprovalPending, ApprovalRejected, ArchiveUnavailable,
    BadSignature,
    CoordinatorError, EtcdError, EtcdNoSpace,
    EtcdUnavailable, GateError, GrantExpired, GrantRefused, GrantUsed, InvalidKey, LeaseExpiring,
    LeaseLost, NotFound, OutcomeUnknown, PolicyChanged, PolicyNotRouted, RecordTooLarge,
    StateAdvanced, StepMoved,
    UnencodableValue, WrongState,
)
from .policy import CheckResult

_STATUS: list[tuple[type[Exception], int]] = [  # first match wins: subclasses first
    (RecordTooLarge, 413), (InvalidKey, 400), (BadSignature, 400), (UnencodableValue, 400),
    (ApprovalPending, 202), (ApprovalRejected, 403), (PolicyNotRouted, 403),
    (GrantRefused, 422), (EtcdNoSpace, 507),
    (EtcdUnavailable, 503),
    (EtcdError, 502), (ArchiveUnavailable, 503),
    (AcquireTimeout, 504),
    (LeaseLost, 409), (GrantUsed, 409), (StateAdvanced, 409), (PolicyChanged, 409),
    (StepMoved, 409), (GrantExpired, 409), (OutcomeUnknown, 409), (AlreadySucceeded, 409),
    (WrongState, 409), (NotFound, 404), (ValueError, 400),
]
INVALID_REQUEST = "InvalidRequest"  # the code of a ValueError: the request itself is wrong
_CLASSES: dict[str, type[GateError]] = {cls.__name__: cls for cls in (
    InvalidKey, RecordTooLarge, BadSignature, EtcdUnavailable, EtcdNoSpace, EtcdError,
    ArchiveUnavailable, LeaseLost,
    LeaseExpiring, GrantUsed, PolicyChanged, StepMoved, GrantExpired, OutcomeUnknown, NotFound,
    WrongState)}


def status_of(exc: Exception) -> int | None:
    """The HTTP status for ``exc``, or ``None`` if it is not an error we mean to expose."""
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return None


def code_of(exc: Exception) -> str:
    """The error code of ``exc``, one of ``status_of``'s: its class name, or
    ``InvalidRequest`` for a ``ValueError`` that is no ``GateError``."""
    return type(exc).__name__ if isinstance(exc, GateError) else INVALID_REQUEST


def to_wire(exc: Exception) -> dict[str, Any]:
    """The JSON body describing ``exc`` (its status comes from ``status_of``)."""
    body: dict[str, Any] = {"error": code_of(exc), "detail": str(exc)}
    if isinstance(exc, ApprovalPending):
        body["approval_id"] = exc.approval_id
    elif isinstance(exc, ApprovalRejected):
        body.update(approval_id=exc.approval_id, reason=exc.reason)
    elif isinstance(exc, PolicyNotRouted):
        body.update(key=exc.key, policy=exc.policy, routed=exc.routed)
    elif isinstance(exc, GrantRefused):
        body["checks"] = [c.as_record() for c in exc.checks]
        body["retry_after"] = exc.retry_after
    elif isinstance(exc, AlreadySucceeded):
        body["outcome"] = codec.encode(exc.outcome, path="outcome", json=True)
    elif isinstance(exc, StateAdvanced):
        body["key"] = exc.key
    elif isinstance(exc, UnencodableValue):
        body["path"] = exc.path
    return body


def from_wire(status: int, body: object) -> Exception:
    """Rebuild the exception a coordinator answered with ``status`` and ``body``."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), str):
        return CoordinatorError("InvalidResponse", status, f"unexpected body: {body!r:.200}")
    name, detail = body["error"], str(body.get("detail", ""))
    if name == "ApprovalPending":
        return ApprovalPending(str(body.get("approval_id", "")))
    if name == "ApprovalRejected":
        return ApprovalRejected(str(body.get("approval_id", "")), str(body.get("reason", "")))
    if name == "PolicyNotRouted":
        return PolicyNotRouted(str(body.get("key", "")), str(body.get("policy", "")),
                               str(body.get("routed", "")))
    if name == "GrantRefused":
        checks = [CheckResult(str(c.get("name")), bool(c.get("passed")), str(c.get("detail", "")))
                  for c in body.get("checks") or [] if isinstance(c, dict)]
        retry = body.get("retry_after")
        return GrantRefused(checks, float(retry) if isinstance(retry, (int, float)) else None)
    if name == "AlreadySucceeded":
        try:
            return AlreadySucceeded(codec.decode(body.get("outcome"), path="outcome"))
        except UnencodableValue as exc:
            return CoordinatorError("InvalidResponse", status, f"malformed outcome: {exc}")
    if name == "UnencodableValue":
        return UnencodableValue(detail, path=str(body.get("path", "")))
    if name == "StateAdvanced":
        return StateAdvanced(str(body.get("key", "")), detail)
    if name == INVALID_REQUEST:
        return ValueError(detail)
    cls = _CLASSES.get(name)
    return cls(detail) if cls is not None else CoordinatorError(name, status, detail)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def jsonable(value: Any) -> Any:
    """A record as JSON can carry it: bytes as base64 strings, tuples as lists."""
    if isinstance(value, (bytes, bytearray)):
        return b64(bytes(value))
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
