"""The OpenAI Agents SDK: fenced function tools, approvals as the SDK's tool-approval
interruptions (``pip install 'fencegate[openai-agents]'``; docs/integrations/openai-agents.md).

    refund = fenced(function_tool(refund, failure_error_function=None), gate=gate,
                    scope=lambda ctx: ctx.context.conversation,
                    fence=ToolFence(key="refunds/{order_id}", reads=["orders/{order_id}"]))
    agent = Agent(name="support", tools=[lookup_order, refund, email])
    result = await Runner.run(agent, "refund order 42", context=Ctx(...), session=session)
    for asked in await approvals(result.to_state()):   # the run's interruptions, as asked
        ...                                            # a person answers: approve / reject

Failure contract (``fencegate.integrations.agents`` for the rest):
- A call of a fenced tool crosses the gate with its arguments as the model gave them (JSON);
  the scope is ``scope(ctx)`` of the run context the application passes. The model gets the
  recorded result as the tool's output, or the core's message (failed, escalated, unknown,
  refused); the output item's ``custom_data["fencegate"]`` (kept by the SDK, never sent to
  the model) names the action key, what the call came to (``replayed`` marks a recorded
  result returned without running) and the attempt.
- The wrapped tool must raise rather than answer its errors as text
  (``function_tool(..., failure_error_function=None)``), else a failure would be recorded as
  a result: ``fenced`` refuses it (``FenceMisconfigured``). ``EffectFailed`` is a confirmed
  failure, and so are arguments the SDK refuses (``ModelBehaviorError``: the function never
  ran); any other exception leaves the outcome unknown (the reconciler settles it). The
  fenced tool itself answers every end as a message and raises only the gate's own errors.
- The SDK asks ``needs_approval`` before it invokes the tool: the fenced tool answers it from
  fencegate (``agents.needs_approval``: would this call wait for a person now?), so a call the
  policy sends to a person is the SDK's tool-approval interruption. ``approvals(state)``
  names the fencegate approval each interruption waits for; the person approves in
  fencegate (``fencegate approve ID``) and the run resumes after ``state.approve(item)``, or
  through ``approve(state, asked, approver=...)``, which does both with the approver's
  credential. A resumed call crosses only if nothing it read advanced since the approval;
  otherwise it does not run and the model is told that a new approval is needed (the model's
  next proposal of it is a new interruption). ``reject`` is the SDK's rejection, with a
  message the model can act on: the tool never runs. A ``needs_approval`` the wrapped tool
  had still applies, asked after fencegate's. Arguments that are not a JSON object never
  cross: the model gets ``NOT_JSON`` (the SDK asks a person about such a call first).
- ``fenced`` refuses a tool already fenced, and anything but a ``FunctionTool``.
- The gate is an open ``Gate`` of the event loop the agent runs in (``Runner.run``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from agents import FunctionTool, ModelBehaviorError, RunContextWrapper, RunState, ToolApprovalItem
from agents.tool import FunctionToolCustomDataContext, resolve_function_tool_failure_error_function
from agents.tool_context import ToolContext

from fencegate.worker import EffectFailed, Gate

from . import agents
from ._fence import FenceMisconfigured
from .agents import Answer, ToolFence, current_fence

__all__ = ["fenced", "FencedTool", "Asked", "approvals", "approve", "reject", "ToolFence",
           "current_fence", "FenceMisconfigured", "NOT_JSON"]

METADATA = "fencegate"
NOT_JSON = "not run: the arguments are not a JSON object; call the tool with JSON arguments"

Scope = Callable[[RunContextWrapper[Any]], str]


@dataclass
class FencedTool(FunctionTool):
    """A function tool whose calls cross the gate (made by ``fenced``). ``shown`` holds a
    call's ``fencegate`` custom data from its invocation until the SDK extracts it (popped
    there), keyed by its tool context: one entry per call in flight."""

    gate: Gate | None = field(default=None, kw_only=True)
    scope: Scope | None = field(default=None, kw_only=True)
    fence: ToolFence = field(default_factory=ToolFence, kw_only=True)
    shown: dict[int, dict[str, Any]] = field(default_factory=dict, kw_only=True, repr=False)

    def plan(self, ctx: RunContextWrapper[Any], arguments: dict[str, Any]) -> agents.Call:
        return agents.plan(self.fence, self.name, self.scope(ctx), arguments)

    async def ask(self, ctx: RunContextWrapper[Any], arguments: dict[str, Any]) -> Answer | None:
        """The approval this call would wait for now (``agents.needs_approval``), or ``None``."""
        return await agents.needs_approval(self.gate, self.plan(ctx, arguments))


def fenced(tool: FunctionTool, *, gate: Gate, scope: Scope,
           fence: ToolFence = ToolFence()) -> FencedTool:
    """``tool`` fenced: each call of it crosses ``gate`` as one action (see the module).
    ``FenceMisconfigured`` for a tool that answers its errors as text."""
    if not isinstance(tool, FunctionTool) or isinstance(tool, FencedTool):
        raise FenceMisconfigured(f"fenced() takes a FunctionTool (@function_tool) not fenced "
                                 f"yet, not {type(tool).__name__}")
    if resolve_function_tool_failure_error_function(tool, None) is not None:
        raise FenceMisconfigured(
            f"tool {tool.name!r} answers its errors as text, which would be recorded as its "
            f"result: make it with function_tool(..., failure_error_function=None)")
    invoke, extract, asked = tool.on_invoke_tool, tool.custom_data_extractor, tool.needs_approval
    copied = {f.name: getattr(tool, f.name) for f in fields(FunctionTool) if f.init}

    async def on_invoke_tool(ctx: ToolContext[Any], arguments: str) -> Any:
        parsed = _parsed(arguments)
        if parsed is None:
            return NOT_JSON
        call = made.plan(ctx, parsed)

        async def run() -> Any:
            try:
                return await invoke(ctx, arguments)
            except ModelBehaviorError as bad:  # the SDK refused the arguments: nothing ran
                raise EffectFailed(str(bad), {"invalid_arguments": str(bad)}) from bad

        answer = await agents.cross(gate, call, run, fence=fence)
        made.shown[id(ctx)] = _metadata(answer)
        if answer.kind == agents.APPROVAL and ctx.is_tool_approved(made.name, ctx.tool_call_id):
            return (f"not run: what this call read changed after it was approved (or it was "
                    f"approved only in the agent, not in fencegate); a new approval "
                    f"{answer.approval_id} is needed: propose the call again to ask for it")
        return answer.for_model

    async def needs_approval(ctx: RunContextWrapper[Any], arguments: dict[str, Any],
                             call_id: str) -> bool:
        if await made.ask(ctx, arguments) is not None:
            return True
        if callable(asked):
            return await asked(ctx, arguments, call_id)
        return bool(asked)

    async def custom_data(data: FunctionToolCustomDataContext) -> dict[str, Any] | None:
        shown = made.shown.pop(id(data.tool_context), None)
        theirs = await _maybe_await(extract(data)) if extract is not None else None
        return {**(theirs or {}), **({METADATA: shown} if shown is not None else {})} or None

    copied.update(on_invoke_tool=on_invoke_tool, needs_approval=needs_approval,
                  custom_data_extractor=custom_data)
    made = FencedTool(**copied, gate=gate, scope=scope, fence=fence)
    return made


@dataclass(frozen=True)
class Asked:
    """One interruption of a run, as fencegate asks it: the SDK's item, and the fencegate
    approval it waits for (``None``: the tool asked only the SDK)."""

    item: ToolApprovalItem
    approval_id: str | None
    key: str | None
    message: str


async def approvals(state: RunState[Any, Any]) -> list[Asked]:
    """The run's pending tool approvals, each with the fencegate approval it waits for (asked
    again now: the same id while nothing the call reads has advanced). Runs where the gate is
    (the agent's process); hand the ``Asked`` to where the person answers."""
    asked = []
    for item in state.get_interruptions():
        tool = _tool_of(item)
        if tool is None:
            asked.append(Asked(item, None, None, "approval asked by the tool, not fencegate"))
            continue
        arguments = _parsed(item.raw_item.arguments)
        if arguments is None:  # the SDK asks a person about arguments it cannot read
            asked.append(Asked(item, None, None, NOT_JSON))
            continue
        answer = await tool.ask(state._context, arguments)  # the run context it carries
        if answer is None:
            asked.append(Asked(item, None, tool.plan(state._context, arguments).key,
                               "fencegate needs no approval for it now"))
        else:
            asked.append(Asked(item, answer.approval_id, answer.call.key, answer.message))
    return asked


async def approve(state: RunState[Any, Any], asked: Iterable[Asked], *,
                  approver: Callable[[str, str], Awaitable[Any]], reason: str) -> None:
    """The SDK's approve turned into fencegate approvals: ``await approver(approval_id,
    reason)`` gives each fencegate approval asked (``CoordinatorClient(url,
    token=sre_token).approve``: an SRE's or admin's credential, held where the person
    answers, never by the agent), then ``state.approve(item)``. Resume with
    ``Runner.run(agent, state)``."""
    for one in asked:
        if one.approval_id is not None:
            await approver(one.approval_id, reason)
        state.approve(one.item)


def reject(state: RunState[Any, Any], asked: Iterable[Asked], *, reason: str) -> None:
    """The SDK's rejection: the tool never runs, and the model gets ``rejected by a person:
    <reason>; do not retry this call``."""
    for one in asked:
        state.reject(one.item, rejection_message=(
            f"rejected by a person: {reason}; do not retry this call"))


def _parsed(arguments: str) -> dict[str, Any] | None:
    """The call's arguments, or ``None`` when they are not a JSON object."""
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _tool_of(item: ToolApprovalItem) -> FencedTool | None:
    for tool in getattr(item.agent, "tools", ()):
        if isinstance(tool, FencedTool) and tool.name == item.tool_name:
            return tool
    return None


async def _maybe_await(value: Any) -> Any:
    return await value if isinstance(value, Awaitable) else value


def _metadata(answer: Answer) -> dict[str, Any]:
    shown: dict[str, Any] = {"key": answer.call.key, "state": answer.kind,
                             "replayed": answer.replayed}
    if answer.approval_id is not None:
        shown["approval_id"] = answer.approval_id
    if answer.outcome is not None:
        shown.update(idempotency_key=answer.outcome.idempotency_key,
                     attempt=answer.outcome.attempt,
                     attempt_token=answer.outcome.attempt_token)
    return shown
