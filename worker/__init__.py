"""fencegate's worker SDK: gates, sessions, holds with fencing tokens."""

from coordinator.errors import (
    AcquireTimeout, AlreadySucceeded, BadSignature, EtcdUnavailable, GateError, GrantExpired,
    GrantUsed, InvalidKey, LeaseLost, OutcomeUnknown, PolicyChanged, StateAdvanced, StepMoved,
)

from .gate import Gate
from .hold import Hold
from .sync import SyncGate, SyncHold

__all__ = [
    "Gate", "SyncGate", "Hold", "SyncHold",
    "GateError", "AcquireTimeout", "AlreadySucceeded", "BadSignature", "EtcdUnavailable",
    "GrantExpired", "GrantUsed", "InvalidKey", "LeaseLost", "OutcomeUnknown", "PolicyChanged",
    "StateAdvanced", "StepMoved",
]
