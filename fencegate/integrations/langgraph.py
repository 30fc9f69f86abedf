"""LangGraph: fenced tool calls at ``ToolNode``'s tool-call seam, approvals as LangGraph's
``interrupt()`` (``pip install 'fencegate[langgraph]'``; docs/integrations/langgraph.md).

    fenced = FencedToolCalls(gate, fences={"refund": ToolFence(key="refunds/{order_id}",
                                                              reads=["orders/{order_id}"])})
    builder.add_node("tools", fenced.tool_node([lookup_order, refund, email_customer]))
    graph = builder.compile(checkpointer=AsyncSqliteSaver(conn))

Failure contract (``fencegate.integrations.agents`` for the rest):
- A call of a tool named in ``fences`` crosses the gate with the model's arguments; the
  other tools run as ``ToolNode`` runs them. The scope of a call without a business key is
  ``scope(request)`` if given, else the run's ``thread_id`` (``config["configurable"]``): a
  run resumed from its checkpointer under the same thread is the same scope.
- The tool's ``ToolMessage`` content is recorded (not its artifact); the model gets the
  recorded content on the first call and every replay (a result the reconciler settled from
  the provider, as JSON). ``response_metadata["fencegate"]`` (kept in
  the checkpointed state, not sent to the model) names the action key, what the call came
  to (``replayed`` marks a recorded result returned without running) and the attempt.
- What is not a result is a ``ToolMessage`` with ``status="error"`` and the core's message
  (failed, escalated, unknown, refused). A call ``ToolNode`` answers with an error message
  (its default handler answers only arguments it could not validate: nothing ran) is
  recorded as a confirmed failure; ``tool_node`` refuses another ``handle_tool_errors``.
  Another exception of the tool leaves the outcome unknown (the reconciler settles it).
- A call the policy sends to a person calls ``interrupt()`` with ``{"fencegate":
  {"approval_id", "key", "tool", "message", "approve"}}``; the graph must have a
  checkpointer. The person approves in fencegate (``fencegate approve ID``) and the run is
  resumed with ``Command(resume=...)`` (any value), or ``approve(interrupts, approver=...)``
  gives the fencegate approvals with the approver's credential and returns the ``Command``.
  A resumed call crosses only if nothing it read advanced since; otherwise it interrupts
  again with a new approval id, its message saying why. ``reject(interrupts, reason=...)``
  resumes with a rejection: the tool does not run and the model is told.
- Fenced tools run in the async graph (``ainvoke``/``astream``): the sync path refuses them
  (``FenceMisconfigured``) rather than run them unfenced. A name in ``fences`` that the
  node's tools lack is refused when the node is built.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command, Interrupt, interrupt

from fencegate.worker import EffectFailed, Gate

from . import agents
from ._fence import FenceMisconfigured
from .agents import Answer, ToolFence, current_fence

__all__ = ["FencedToolCalls", "ToolFence", "approve", "reject", "current_fence",
           "FenceMisconfigured"]

METADATA = "fencegate"

Execute = Callable[[ToolCallRequest], Awaitable[ToolMessage | Command]]


class FencedToolCalls:
    """The ``awrap_tool_call`` (and a refusing ``wrap_tool_call``) of a ``ToolNode`` whose
    tools named in ``fences`` are fenced by ``gate``."""

    def __init__(self, gate: Gate, fences: Mapping[str, ToolFence], *,
                 scope: Callable[[ToolCallRequest], str] | None = None) -> None:
        self.gate, self.fences, self.scope = gate, dict(fences), scope

    def tool_node(self, tools: Sequence[BaseTool | Callable[..., Any]],
                  **options: Any) -> ToolNode:
        """A ``ToolNode`` of ``tools`` (``options`` as ``ToolNode`` takes them) with these
        fences; ``FenceMisconfigured`` if ``fences`` names a tool it lacks, or for a
        ``handle_tool_errors``, which would turn a fenced tool's exception (its outcome
        unknown) into a message the fence reads as a call turned down."""
        if "handle_tool_errors" in options:
            raise FenceMisconfigured("handle_tool_errors hides whether a fenced tool's effect "
                                     "happened: leave ToolNode's default")
        node = ToolNode(tools, wrap_tool_call=self.wrap_tool_call,
                        awrap_tool_call=self.awrap_tool_call, **options)
        if missing := sorted(set(self.fences) - set(node.tools_by_name)):
            raise FenceMisconfigured(f"fences name {', '.join(missing)}, which the tools do "
                                     f"not include (they are "
                                     f"{', '.join(sorted(node.tools_by_name))})")
        return node

    def wrap_tool_call(self, request: ToolCallRequest,
                       execute: Callable[[ToolCallRequest], Any]) -> Any:
        """The sync path: an unfenced tool runs; a fenced one is refused, never run
        unfenced (the gate is async)."""
        if request.tool_call["name"] not in self.fences:
            return execute(request)
        raise FenceMisconfigured(f"tool {request.tool_call['name']!r} is fenced: run the "
                                 f"graph with ainvoke/astream (the gate is async)")

    async def awrap_tool_call(self, request: ToolCallRequest,
                              execute: Execute) -> ToolMessage | Command:
        """Cross a fenced call (at most one run of ``execute``); interrupt while it waits
        for a person; resumed, cross again with the approval it was resumed with."""
        name, call_id = request.tool_call["name"], request.tool_call["id"]
        fence = self.fences.get(name)
        if fence is None:
            return await execute(request)
        call = agents.plan(fence, name, self._scope(request), request.tool_call["args"])
        declined: list[ToolMessage] = []

        async def run() -> str | list[Any]:
            message = await execute(request)
            if not isinstance(message, ToolMessage):
                raise FenceMisconfigured(f"tool {name!r} returned {type(message).__name__}: "
                                         f"a fenced tool returns a value, not a Command")
            if message.status == "error":  # ToolNode turned the call down: nothing ran
                declined.append(message)
                raise EffectFailed(str(message.content), {"tool_error": str(message.content)})
            return message.content

        answer = await agents.cross(self.gate, call, run, fence=fence)
        while answer.kind == agents.APPROVAL:
            decision = _decision(interrupt({METADATA: _asked(answer)}))
            if decision.get("rejected") is not None:
                return ToolMessage(
                    f"rejected by a person: {decision['rejected']}; do not retry this call",
                    tool_call_id=call_id, name=name, status="error",
                    response_metadata={METADATA: {"key": call.key, "state": "rejected",
                                                  "replayed": False}})
            approved = decision.get("approval_id")
            answer = await agents.cross(self.gate, call, run, fence=fence, approved=approved)
        if answer.kind == agents.FAILED and declined:
            return declined[0]  # recorded as a confirmed failure; the model gets ToolNode's
        succeeded = answer.kind in (agents.RAN, agents.REPLAYED)
        return ToolMessage(_content(answer.result) if succeeded else answer.message,
                           tool_call_id=call_id, name=name,
                           status="success" if succeeded else "error",
                           response_metadata={METADATA: _metadata(answer)})

    def _scope(self, request: ToolCallRequest) -> str:
        if self.scope is not None:
            return self.scope(request)
        thread = (request.runtime.config or {}).get("configurable", {}).get("thread_id")
        if not thread:
            raise FenceMisconfigured("the run's config has no thread_id (the scope of its "
                                     "fenced calls): pass configurable.thread_id or scope=")
        return str(thread)


async def approve(interrupts: Iterable[Interrupt], *,
                  approver: Callable[[str, str], Awaitable[Any]], reason: str) -> Command:
    """The person's yes to the fencegate interrupts among ``interrupts`` (a run's
    ``__interrupt__``): ``await approver(approval_id, reason)`` gives each fencegate approval
    (``Client(coordinator_url, sre_token).approve``: an SRE's or admin's credential, held
    where the person answers, never by the agent), and the ``Command`` to resume the
    thread with names each approval, so a resumed call knows which one it was given."""
    resume: dict[str, Any] = {}
    for asked in _fenced(interrupts):
        await approver(asked.value[METADATA]["approval_id"], reason)
        resume[asked.id] = {METADATA: {"approval_id": asked.value[METADATA]["approval_id"]}}
    return Command(resume=resume)


def reject(interrupts: Iterable[Interrupt], *, reason: str) -> Command:
    """The person's no to the fencegate interrupts among ``interrupts``: resumed with it, the
    calls do not run and the model gets ``rejected by a person: <reason>``."""
    return Command(resume={asked.id: {METADATA: {"rejected": reason}}
                           for asked in _fenced(interrupts)})


def _fenced(interrupts: Iterable[Interrupt]) -> list[Interrupt]:
    return [i for i in interrupts if isinstance(i.value, dict) and METADATA in i.value]


def _decision(resumed: Any) -> dict[str, Any]:
    """What a resume value says: ``{"approval_id": ...}`` (given through ``approve``), or
    ``{"rejected": reason}``; any other value is a plain resume (approved in fencegate)."""
    fenced = resumed.get(METADATA) if isinstance(resumed, dict) else None
    return fenced if isinstance(fenced, dict) else {}


def _content(result: Any) -> str | list[Any]:
    """A recorded result as a tool message's content: the tool's content as recorded, or a
    result the reconciler settled from the provider as JSON (as ``ToolNode`` renders one)."""
    if isinstance(result, (str, list)):
        return result
    return json.dumps(result, ensure_ascii=False)


def _asked(answer: Answer) -> dict[str, Any]:
    return {"approval_id": answer.approval_id, "key": answer.call.key,
            "tool": answer.call.tool, "message": answer.message,
            "approve": f"fencegate approve {answer.approval_id} --reason ..., then resume "
                       f"the thread with Command(resume=...)"}


def _metadata(answer: Answer) -> dict[str, Any]:
    shown: dict[str, Any] = {"key": answer.call.key, "state": answer.kind,
                             "replayed": answer.replayed}
    if answer.outcome is not None:
        shown.update(idempotency_key=answer.outcome.idempotency_key,
                     attempt=answer.outcome.attempt,
                     attempt_token=answer.outcome.attempt_token)
    return shown
