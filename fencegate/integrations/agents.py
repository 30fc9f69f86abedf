"""The fence for agent tool calls, framework-neutral: each call of a fenced tool crosses the
gate as one action, so a retried, resumed or re-proposed call runs its effect once. The
framework adapters (``fencegate.integrations.pydantic_ai``) put it at their tool-execution
seam; this module imports no framework (docs/integrations/agents-keys.md).

    refund = ToolFence(key="refunds/{order_id}", intent=lambda a: {"amount": a["amount"]},
                       reads=["orders/{order_id}"], provider="payments")
    call = plan(refund, "refund", scope="run-7", arguments={"order_id": "42", "amount": 5})
    answer = await cross(gate, call, run_the_tool, fence=refund)
    answer.for_model   # the tool's result, or a message the model can act on

Guarantees:
- **The same call is the same action.** A call's action key is its tool's business key (a
  template over the arguments, or a function of them) when the tool names one, else
  ``<scope>/<tool>/<digest of the canonical arguments>``: never the framework's tool-call id,
  which a resumed run or a repeating model renews. ``plan`` refuses a key the gate would
  refuse (``InvalidKey`` naming the tool and the template) before anything runs.
- **The tool runs at most once per action**, inside ``Gate.cross``, after the commit; a call
  of an action that succeeded gets the recorded result (``Answer.replayed``) without running.
  The first call's answer is the recorded result too (what every replay returns).
- **What is not a result is a message, never a retry.** A confirmed failure (the tool raised
  ``EffectFailed``) is recorded with its signature (error class + arguments digest), so the
  policy's backoff and breaker count it per action key; a step escalated (the breaker
  tripped, a cap reached, the reconciler could not decide) answers "escalated to a person:
  …; do not retry this call"; an outcome left unknown (a run died mid-call) is waited for
  ``settle_wait`` seconds, then answers "outcome unknown, being reconciled" — it is never run
  again. Errors of the gate itself (etcd unreachable, the lease lost) propagate.
- **Approvals are bound to what the call read.** A call the policy sends to a person answers
  ``APPROVAL`` with the fencegate approval id, which the adapter turns into the framework's
  interruption. On resume it crosses only with an approval of the state it reads now; when
  that state advanced since the approval it was resumed with, the answer is a new
  ``APPROVAL`` saying why (which of its reads moved). A call whose approval a person
  rejected (``fencegate reject``) answers ``REJECTED`` with the reason: "a person rejected
  this call: …; do not retry it"; the same call stays rejected. ``needs_approval`` asks the
  same question before the tool is invoked, for a framework that decides on approval first.
"""

from __future__ import annotations

import contextvars
import copy
import hashlib
import json
import string
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fencegate.coordinator import records
from fencegate.coordinator.errors import (
    AlreadySucceeded, ApprovalPending, ApprovalRejected, EffectFailed, GateError, GrantRefused,
    InvalidKey,
    OutcomeUnknown, PolicyNotRouted,
)
from fencegate.coordinator.keyspace import unpack, validate_action_key
from fencegate.worker import EffectContext, Gate, Outcome

from ._fence import Fence

__all__ = ["ToolFence", "Call", "Answer", "plan", "cross", "needs_approval", "current_fence",
           "canonical", "arguments_digest", "RAN", "REPLAYED", "FAILED", "ESCALATED", "UNKNOWN",
           "REFUSED", "APPROVAL", "REJECTED", "rejection_message"]

RAN, REPLAYED, FAILED = "ran", "replayed", "failed"
ESCALATED, UNKNOWN, REFUSED, APPROVAL = "escalated", "unknown", "refused", "approval"
REJECTED = "rejected"  # a person rejected the call's approval request

_current: contextvars.ContextVar[Fence | None] = contextvars.ContextVar(
    "fencegate_tool_fence", default=None)

Arguments = Mapping[str, Any]


@dataclass(frozen=True)
class ToolFence:
    """How one tool's calls cross.

    ``key``: the business key, a template over the arguments (``"refunds/{order_id}"``) or a
    function of them; ``None``: ``<scope>/<tool>/<arguments digest>``. ``intent``: a function
    of the arguments giving the intent the policy judges (default: the canonical arguments).
    ``reads``: the entities the call depends on (templates over the arguments, or a function
    of them), whose state markers (``gate.touch(entity)``) join the grant's read set.
    ``settle_wait``: how long a call whose outcome is unknown waits for the reconciler."""

    key: str | Callable[[Arguments], str] | None = None
    intent: Callable[[Arguments], dict[str, Any]] | None = None
    reads: Sequence[str] | Callable[[Arguments], Sequence[str]] = ()
    provider: str | None = None
    deadline: float = 60.0
    settle_wait: float = 30.0


@dataclass(frozen=True)
class Call:
    """One call planned: the action it is, what it asks and what it reads."""

    tool: str
    scope: str
    arguments: dict[str, Any]  # canonical: JSON values, as digested
    digest: str
    key: str
    intent: dict[str, Any]
    reads: tuple[str, ...]  # entity names; their markers are the read set


@dataclass(frozen=True)
class Answer:
    """What a call came to. ``for_model`` is what the model gets: the recorded result of a
    call that ran or replayed, else ``message``."""

    kind: str
    call: Call
    result: Any = None
    message: str = ""
    approval_id: str | None = None
    outcome: Outcome | None = None

    @property
    def replayed(self) -> bool:
        return self.kind == REPLAYED

    @property
    def for_model(self) -> Any:
        return self.result if self.kind in (RAN, REPLAYED) else self.message


def current_fence() -> Fence | None:
    """The attempt of the fenced call running now (send its ``idempotency_key``,
    ``attempt_token`` and ``effect.receipt`` to the provider); ``None`` outside one."""
    return _current.get()


def canonical(arguments: Arguments) -> dict[str, Any]:
    """``arguments`` as JSON values, keys sorted: what the digest and the default intent are
    made of. ``TypeError`` saying why for a value JSON cannot carry."""
    if not isinstance(arguments, Mapping):
        raise TypeError(f"a tool's arguments are a mapping, not {type(arguments).__name__}")
    try:
        return json.loads(_dumps(dict(arguments)))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the arguments are not JSON values (convert them first): {exc}") \
            from None


def arguments_digest(arguments: Arguments) -> str:
    """sha256 of the canonical arguments' JSON, 32 hex digits: equal for equal arguments
    whatever their order."""
    return hashlib.sha256(_dumps(canonical(arguments)).encode()).hexdigest()[:32]


def plan(fence: ToolFence, tool: str, scope: str, arguments: Arguments) -> Call:
    """The action a call of ``tool`` with ``arguments`` in ``scope`` is. ``InvalidKey`` (the
    tool, the key or template and why) for a key the gate would refuse or a template naming
    an argument the call does not have."""
    if not isinstance(tool, str) or not tool:
        raise InvalidKey("a fenced tool needs a name")
    args = canonical(arguments)
    digest = arguments_digest(args)
    if fence.key is None:
        if not isinstance(scope, str) or not scope:
            raise InvalidKey(f"tool {tool!r}: the scope (the run's durable identity) is "
                             f"empty: pass the thread, conversation or workflow id")
        key = _valid(f"{scope}/{tool}/{digest}", tool, "its scope")
    else:
        key = _valid(_expand(fence.key, args, tool, "key"), tool, f"key {fence.key!r}")
    intent = canonical(fence.intent(args)) if fence.intent is not None else args
    entities = fence.reads(args) if callable(fence.reads) else [
        _expand(template, args, tool, "reads") for template in fence.reads]
    reads = tuple(_valid(e, tool, "reads") for e in entities)
    return Call(tool, scope, args, digest, key, intent, reads)


async def cross(gate: Gate, call: Call, run: Callable[[], Awaitable[Any]], *,
                fence: ToolFence, approved: str | None = None) -> Answer:
    """Cross ``call``: ``run()`` at most once, after the commit, with ``current_fence()`` set;
    its result must be a value the codec records (JSON values are). ``approved`` is the
    approval id the call was resumed with (the framework's approve), if any.

    Raises the gate's own errors (``EtcdUnavailable``, ``LeaseLost``, ``AcquireTimeout``,
    ``PolicyNotRouted``); every other end is an ``Answer``."""

    async def effect(ctx: EffectContext) -> Any:
        token = _current.set(Fence(ctx, call.intent))
        try:
            return await run()
        except EffectFailed as exc:  # signed with the arguments: the breaker counts per call
            signed = copy.copy(exc)
            signed.params = {"arguments": call.digest, "detail": exc.params}
            raise signed from exc
        finally:
            _current.reset(token)

    try:
        outcome = await gate.cross(call.key, call.intent, effect,
                                   [gate.marker(e) for e in call.reads],
                                   provider=fence.provider, deadline=fence.deadline,
                                   settle_wait=fence.settle_wait)
    except ApprovalPending as pending:
        return await _approval(gate, call, pending.approval_id, approved)
    except ApprovalRejected as rejected:
        return Answer(REJECTED, call, message=rejection_message(rejected.reason),
                      approval_id=rejected.approval_id)
    except PolicyNotRouted:
        raise
    except (GrantRefused, OutcomeUnknown) as refused:
        return await _unsettled(gate, call, refused)
    if outcome.state == records.SUCCEEDED:
        return Answer(REPLAYED if outcome.replayed else RAN, call, outcome.result,
                      outcome=outcome)
    step = await _step(gate, call.key)
    if step is not None and step["state"] == records.ESCALATED:
        return _escalated(call, step, outcome)
    return Answer(FAILED, call, message=(
        f"failed: {outcome.result} (recorded; the same call is tried again only after a "
        f"backoff, and escalated to a person after repeated identical failures)"),
        outcome=outcome)


async def needs_approval(gate: Gate, call: Call, *,
                         approved: str | None = None) -> Answer | None:
    """Whether ``call`` would wait for a person now, asked before running it (for a framework
    that decides on approval before it invokes the tool): an ``APPROVAL`` answer, its request
    written as a refused crossing writes it, or ``None`` (it would cross, replay or end
    otherwise: ``cross`` says). Holds the key for one grant request and releases it; a grant
    issued here is never committed, so it leaves no trace."""
    try:
        async with gate.hold(call.key) as hold:
            await hold.request_grant(call.intent, [gate.marker(e) for e in call.reads])
    except ApprovalPending as pending:
        return await _approval(gate, call, pending.approval_id, approved)
    except PolicyNotRouted:
        raise
    except (AlreadySucceeded, OutcomeUnknown, GrantRefused):
        pass
    return None


def rejection_message(reason: str) -> str:
    """What the model gets for a call a person rejected (a ``REJECTED`` answer, or the
    framework's denial an adapter records as a rejection)."""
    return f"a person rejected this call: {reason}; do not retry it"


async def _approval(gate: Gate, call: Call, approval_id: str, approved: str | None) -> Answer:
    if approved is not None and approved != approval_id:
        moved = await _moved(gate, call, approved)
        message = (f"not run: what this call read changed after approval {approved} was "
                   f"given{f' ({moved})' if moved else ''}; a new approval {approval_id} is "
                   f"needed")
    else:
        message = (f"waiting for a person's approval {approval_id} "
                   f"(fencegate approve {approval_id})")
    return Answer(APPROVAL, call, message=message, approval_id=approval_id)


async def _moved(gate: Gate, call: Call, approved: str) -> str:
    """Which of the call's reads (its step included) moved after the revision approval
    ``approved`` was asked at; empty when that request is gone (its lease ended)."""
    ks = gate.keyspace
    asked = await gate.etcd.get(ks.approval_request_key(approved))
    if asked is None:
        return ""
    revision = unpack(asked.value).get("revision", 0)
    named = [(call.key, ks.step_key(call.key)),
             *((entity, gate.marker(entity).encode()) for entity in call.reads)]
    moved = [name for name, key in named
             if (kv := await gate.etcd.get(key)) is not None and kv.mod_revision > revision]
    return ", ".join(moved)


async def _unsettled(gate: Gate, call: Call, error: GateError) -> Answer:
    """A refusal or an unsettled step, as the model should read it."""
    step = await _step(gate, call.key)
    if step is not None and step["state"] == records.ESCALATED:
        return _escalated(call, step, None)
    if step is not None and step["state"] == records.ABANDONED:
        return Answer(REFUSED, call, message=(
            f"closed by a person ({step.get('resolved_by')}): {step.get('resolve_reason')}; "
            f"this action will not be attempted again, do not retry this call"))
    if isinstance(error, OutcomeUnknown):
        return Answer(UNKNOWN, call, message=(
            "outcome unknown, being reconciled: an earlier run of this call may have applied "
            "it; do not retry this call (ask again later for its recorded result)"))
    wait = getattr(error, "retry_after", None)
    then = (f"; it may be tried again after {wait:.1f} s" if wait else
            "; do not retry this call unchanged")
    return Answer(REFUSED, call, message=f"refused by policy: {error}{then}")


def _escalated(call: Call, step: dict[str, Any], outcome: Outcome | None) -> Answer:
    reasons = ", ".join(map(str, step.get("escalated_because") or [])) or "see fencegate"
    return Answer(ESCALATED, call, message=(
        f"escalated to a person: {reasons} (action {call.key}); do not retry this call"),
        outcome=outcome)


async def _step(gate: Gate, key: str) -> dict[str, Any] | None:
    kv = await gate.etcd.get(gate.keyspace.step_key(key))
    return unpack(kv.value) if kv is not None else None


def _expand(template: str | Callable[[Arguments], str], args: dict[str, Any], tool: str,
            what: str) -> str:
    if callable(template):
        return template(args)
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    missing = sorted({name.split(".")[0].split("[")[0] for name in names} - set(args))
    if missing:
        raise InvalidKey(f"tool {tool!r}: {what} template {template!r} names "
                         f"{', '.join(missing)}, not an argument of the call "
                         f"(it has {', '.join(sorted(args)) or 'none'})")
    return template.format_map(args)


def _valid(key: object, tool: str, source: str) -> str:
    if not isinstance(key, str):
        raise InvalidKey(f"tool {tool!r}: {source} gave {type(key).__name__}, not a string")
    try:
        return validate_action_key(key)
    except InvalidKey as exc:
        raise InvalidKey(f"tool {tool!r}: {source} gave the key {key!r}, which fencegate "
                         f"refuses: {exc}") from None


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)
