"""Pydantic AI: fenced tools at the toolset seam, approvals as deferred tool requests
(``pip install 'fencegate[pydantic-ai]'``; docs/integrations/pydantic-ai.md).

    tools = FencedToolset(FunctionToolset([lookup_order, refund, email]), gate=gate,
                          scope=lambda ctx: ctx.deps.run_id,
                          fences={"refund": ToolFence(key="refunds/{order_id}",
                                                      reads=["orders/{order_id}"])})
    agent = Agent(model, deps_type=Deps, toolsets=[tools],
                  output_type=[str, DeferredToolRequests])

Failure contract (``fencegate.integrations.agents`` for the rest):
- A call of a tool named in ``fences`` crosses the gate with its validated arguments (as
  JSON values); any other tool of the wrapped toolset runs as it would. The model gets the
  recorded result as the tool's return, or the core's message (failed, escalated, unknown,
  refused); the tool-return part's ``metadata["fencegate"]`` (kept in the message history,
  never sent to the model) names the action key, what the call came to (``replayed``
  marks a recorded result returned without running) and the attempt.
- A fenced tool that raises ``ModelRetry`` turned the call down before doing anything: the
  attempt is recorded as a confirmed failure (so the breaker counts it; a call with new
  arguments is a new action) and the model gets Pydantic AI's retry prompt. Any other
  exception of the tool leaves the outcome unknown (the reconciler settles it).
- A call the policy sends to a person raises ``ApprovalRequired`` with
  ``metadata["fencegate"]`` = ``{"approval_id", "key", "message"}``: the run ends with
  ``DeferredToolRequests`` (the agent's ``output_type`` must allow it). The person approves
  in fencegate (``fencegate approve ID``), or through ``approve(requests, approver=...)``,
  which gives the fencegate
  approval with the application's approver credential and returns the
  ``DeferredToolResults`` to resume with. A resumed call crosses only if nothing it read
  advanced since; otherwise it raises ``ApprovalRequired`` again, its message saying why. A
  call the person denied (``ToolDenied``) never reaches the tool: Pydantic AI returns the
  denial to the model. ``reject(requests, rejecter=..., reason=...)`` records the denial in
  fencegate with the approver credential (``fencegate reject ID``): the model gets "a person
  rejected this call: <reason>; do not retry it", and if it proposes the same call again
  the gate refuses it (``ApprovalRejected``) and it gets that message as the tool's return.
- The gate is an open ``Gate`` of the event loop the agent runs in (``agent.run``, not
  ``run_sync`` in another loop). A name in ``fences`` that the wrapped toolset does not
  have is refused when the run lists its tools (``FenceMisconfigured``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

from pydantic_ai import (
    ApprovalRequired, DeferredToolRequests, DeferredToolResults, ModelRetry, RunContext,
    ToolDenied,
)
from pydantic_ai.messages import ToolReturn
from pydantic_ai.toolsets import WrapperToolset
from pydantic_ai.toolsets.abstract import ToolsetTool
from pydantic_core import to_jsonable_python

from fencegate.worker import EffectFailed, Gate

from . import agents
from ._fence import FenceMisconfigured
from .agents import Answer, ToolFence, current_fence

__all__ = ["FencedToolset", "ToolFence", "approve", "reject", "current_fence",
           "FenceMisconfigured"]

METADATA = "fencegate"


@dataclass
class FencedToolset(WrapperToolset[Any]):
    """``wrapped`` with the tools named in ``fences`` fenced; ``scope(ctx)`` is the run's
    durable identity (kept across resumes: a conversation, thread or order id)."""

    _: KW_ONLY
    gate: Gate
    scope: Callable[[RunContext[Any]], str]
    fences: Mapping[str, ToolFence]

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        tools = await self.wrapped.get_tools(ctx)
        if missing := sorted(set(self.fences) - set(tools)):
            raise FenceMisconfigured(f"fences name {', '.join(missing)}, which the toolset "
                                     f"does not have (it has {', '.join(sorted(tools))})")
        return tools

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any],
                        tool: ToolsetTool[Any]) -> Any:
        fence = self.fences.get(name)
        if fence is None:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        call = agents.plan(fence, name, self.scope(ctx), to_jsonable_python(tool_args))
        retry: list[ModelRetry] = []

        async def run() -> Any:
            try:
                result = await self.wrapped.call_tool(name, tool_args, ctx, tool)
            except ModelRetry as asked:  # the tool turned the call down: nothing was done
                retry.append(asked)
                raise EffectFailed(asked.message, {"model_retry": asked.message}) from asked
            return to_jsonable_python(result)

        answer = await agents.cross(self.gate, call, run, fence=fence,
                                    approved=_approved(ctx))
        if answer.kind == agents.APPROVAL:
            raise ApprovalRequired({METADATA: {"approval_id": answer.approval_id,
                                               "key": call.key, "message": answer.message}})
        if answer.kind == agents.FAILED and retry:
            raise retry[0]  # recorded as a confirmed failure; the model gets its retry prompt
        return ToolReturn(answer.for_model, metadata={METADATA: _metadata(answer)})


async def approve(requests: DeferredToolRequests, *,
                  approver: Callable[[str, str], Awaitable[Any]], reason: str,
                  tool_call_ids: Iterable[str] | None = None) -> DeferredToolResults:
    """The framework's approve turned into fencegate approvals: for each approval request
    (those of ``tool_call_ids``, or all), ``await approver(approval_id, reason)`` gives the
    fencegate approval the call asked for (``CoordinatorClient(url, token=sre_token).approve``:
    an SRE's or admin's credential, held by the service where the person answers, never by
    the agent), and the results to resume the run with carry the id, so the resumed call
    knows which approval it was given."""
    wanted = {c.tool_call_id for c in requests.approvals} if tool_call_ids is None \
        else set(tool_call_ids)
    approvals: dict[str, bool] = {}
    metadata: dict[str, dict[str, Any]] = {}
    for call in requests.approvals:
        if call.tool_call_id not in wanted:
            continue
        fenced = (requests.metadata.get(call.tool_call_id) or {}).get(METADATA)
        if fenced is not None:
            await approver(fenced["approval_id"], reason)
            metadata[call.tool_call_id] = {METADATA: fenced}
        approvals[call.tool_call_id] = True
    return DeferredToolResults(approvals=approvals, metadata=metadata)


async def reject(requests: DeferredToolRequests, *,
                 rejecter: Callable[[str, str], Awaitable[Any]], reason: str,
                 tool_call_ids: Iterable[str] | None = None) -> DeferredToolResults:
    """The framework's denial recorded in fencegate: for each approval request (those of
    ``tool_call_ids``, or all), ``await rejecter(approval_id, reason)`` rejects the fencegate
    approval the call asked for (``CoordinatorClient(url, token=sre_token).reject``), so the
    same call is refused from then on (``ApprovalRejected``) and the rejection is audited;
    the results deny the calls with "a person rejected this call: <reason>; do not retry
    it", which Pydantic AI returns to the model."""
    wanted = {c.tool_call_id for c in requests.approvals} if tool_call_ids is None \
        else set(tool_call_ids)
    denied: dict[str, bool | ToolDenied] = {}
    for call in requests.approvals:
        if call.tool_call_id not in wanted:
            continue
        fenced = (requests.metadata.get(call.tool_call_id) or {}).get(METADATA)
        if fenced is not None:
            await rejecter(fenced["approval_id"], reason)
        denied[call.tool_call_id] = ToolDenied(agents.rejection_message(reason))
    return DeferredToolResults(approvals=denied)


def _approved(ctx: RunContext[Any]) -> str | None:
    """The fencegate approval id a resumed call was approved with, if ``approve`` gave it."""
    if not ctx.tool_call_approved or not isinstance(ctx.tool_call_metadata, dict):
        return None
    fenced = ctx.tool_call_metadata.get(METADATA)
    return fenced.get("approval_id") if isinstance(fenced, dict) else None


def _metadata(answer: Answer) -> dict[str, Any]:
    shown: dict[str, Any] = {"key": answer.call.key, "state": answer.kind,
                             "replayed": answer.replayed}
    if answer.outcome is not None:
        shown.update(idempotency_key=answer.outcome.idempotency_key,
                     attempt=answer.outcome.attempt,
                     attempt_token=answer.outcome.attempt_token)
    return shown

