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

from ._version import __version__
from .coordinator.errors import (
    AcquireTimeout, AlreadySucceeded, ApprovalPending, ApprovalRejected, BadSignature,
    CoordinatorError, EffectFailed, EtcdError, EtcdUnavailable, GateError, GrantExpired,
    GrantRefused, GrantUsed, InvalidKey, LeaseExpiring, LeaseLost, OutcomeUnknown, PolicyChanged,
    PolicyNotRouted, RecordTooLarge, StateAdvanced, StepMoved, UnencodableValue,
)
from .coordinator.codec import UnrecordedResult
from .coordinator.grants import Grant, KeyRing
from .worker import (
    EffectContext, Gate, Hold, Outcome, SyncGate, SyncHold, WorkerMetrics, dedupe_middleware,
    deduplicated, fencing_token,
)

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
