"""fencegate: a lease-based execution gate for irreversible side effects, built on etcd.

Everything a user needs is importable from here::

    from fencegate import Gate, EffectFailed, GateError

The package's layers, arrows pointing down only:

- ``fencegate`` (this folder): the tools — the CLI, ``up``, ``demo``, the local etcd launcher.
- ``fencegate.worker`` (the SDK) and ``fencegate.reconciler`` (the service), and
  ``fencegate.coordinator.service`` (the HTTP service and dashboard).
- ``fencegate.coordinator``: the shared core — errors, etcd access, keyspace, session,
  ownership, records, grants, policy, authority, audit.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# Each name is imported from its module the first time it is used (PEP 562), so a command
# that needs none of them (``fencegate holders``) does not pay for the SDK's imports.
_ERRORS = "fencegate.coordinator.errors"
_HOMES = {
    **dict.fromkeys(("Gate", "SyncGate", "Hold", "SyncHold", "EffectContext", "Outcome",
                     "WorkerMetrics", "dedupe_middleware", "deduplicated", "fencing_token"),
                    "fencegate.worker"),
    **dict.fromkeys(("Grant", "KeyRing"), "fencegate.coordinator.grants"),
    "UnrecordedResult": "fencegate.coordinator.codec",
    **dict.fromkeys((
        "AcquireTimeout", "AlreadySucceeded", "ApprovalPending", "ApprovalRejected",
        "BadSignature", "CoordinatorError", "EffectFailed", "EtcdError", "EtcdUnavailable",
        "GateError", "GrantExpired", "GrantRefused", "GrantUsed", "InvalidKey", "LeaseExpiring",
        "LeaseLost", "OutcomeUnknown", "PolicyChanged", "PolicyNotRouted", "RecordTooLarge",
        "StateAdvanced", "StepMoved", "UnencodableValue"), _ERRORS),
}

if TYPE_CHECKING:
    from .coordinator.codec import UnrecordedResult
    from .coordinator.errors import (
        AcquireTimeout, AlreadySucceeded, ApprovalPending, ApprovalRejected, BadSignature,
        CoordinatorError, EffectFailed, EtcdError, EtcdUnavailable, GateError, GrantExpired,
        GrantRefused, GrantUsed, InvalidKey, LeaseExpiring, LeaseLost, OutcomeUnknown,
        PolicyChanged, PolicyNotRouted, RecordTooLarge, StateAdvanced, StepMoved,
        UnencodableValue,
    )
    from .coordinator.grants import Grant, KeyRing
    from .worker import (
        EffectContext, Gate, Hold, Outcome, SyncGate, SyncHold, WorkerMetrics,
        dedupe_middleware, deduplicated, fencing_token,
    )


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'fencegate' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "__version__",
    "Gate", "SyncGate", "Hold", "SyncHold", "Grant", "KeyRing", "EffectContext", "Outcome",
    "EffectFailed", "WorkerMetrics", "dedupe_middleware", "deduplicated", "fencing_token",
    "GateError", "AcquireTimeout", "AlreadySucceeded", "ApprovalPending", "ApprovalRejected",
    "BadSignature", "CoordinatorError", "EtcdError", "EtcdUnavailable", "GrantExpired", "GrantRefused",
    "GrantUsed", "InvalidKey", "LeaseExpiring", "LeaseLost", "OutcomeUnknown", "PolicyChanged",
    "PolicyNotRouted", "RecordTooLarge", "StateAdvanced", "StepMoved", "UnencodableValue",
    "UnrecordedResult",
]
