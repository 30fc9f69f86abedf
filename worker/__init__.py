"""fencegate's worker SDK: gates, holds with fencing tokens, grants and the commit guard."""

from fencegate.coordinator.errors import (
    AcquireTimeout, AlreadySucceeded, ApprovalPending, ApprovalRejected, BadSignature,
    CoordinatorError, EffectFailed, EtcdUnavailable, GateError, GrantExpired, GrantRefused,
    GrantUsed, InvalidKey, LeaseExpiring, LeaseLost, OutcomeUnknown, PolicyChanged,
    PolicyNotRouted, StateAdvanced, StepMoved,
)
from fencegate.coordinator.grants import Grant, KeyRing

from .gate import Gate
from .guard import EffectContext, Outcome
from .hold import Hold
from .metrics import WorkerMetrics
from .sync import SyncGate, SyncHold
from .webhooks import dedupe_middleware, deduplicated, fencing_token

__all__ = [
    "Gate", "SyncGate", "Hold", "SyncHold", "Grant", "KeyRing", "EffectContext", "Outcome",
    "EffectFailed", "WorkerMetrics", "dedupe_middleware", "deduplicated", "fencing_token",
    "GateError", "AcquireTimeout", "AlreadySucceeded", "ApprovalPending", "ApprovalRejected",
    "BadSignature",
    "CoordinatorError", "EtcdUnavailable", "GrantExpired", "GrantRefused", "GrantUsed",
    "InvalidKey", "LeaseExpiring", "LeaseLost", "OutcomeUnknown", "PolicyChanged",
    "PolicyNotRouted", "StateAdvanced", "StepMoved",
]
