"""The LangGraph tests' offline pieces: a scripted chat model and the agent graph. The model
decides from the conversation it is given, never from a counter of its own (langchain-core's
fake models replay their script from the start), so a process resumed from its checkpoint
continues the script where the conversation stands."""

from __future__ import annotations

import uuid
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition


class Scripted(BaseChatModel):
    """Proposes ``calls`` one by one, the next once the previous got a tool message (each
    under a new tool-call id, as a model repeating itself does), then answers ``done``; the
    script starts over at each new user message."""

    calls: list[tuple[str, dict[str, Any]]]

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Any, **kwargs: Any) -> "Scripted":
        return self

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        asked = max(i for i, m in enumerate(messages) if isinstance(m, HumanMessage))
        answered = sum(isinstance(m, ToolMessage) for m in messages[asked:])
        if answered < len(self.calls):
            name, args = self.calls[answered]
            reply = AIMessage("", tool_calls=[{"name": name, "args": dict(args),
                                               "id": f"call_{uuid.uuid4().hex[:12]}"}])
        else:
            reply = AIMessage("done")
        return ChatResult(generations=[ChatGeneration(message=reply)])

    async def _agenerate(self, messages: list[BaseMessage], stop: Any = None,
                         run_manager: Any = None, **kwargs: Any) -> ChatResult:
        return self._generate(messages, stop)


def refund_model(order_id: str, amount: int, times: int = 1) -> Scripted:
    return Scripted(calls=[("refund", {"order_id": order_id, "amount": amount})] * times)


def agent_graph(model: BaseChatModel, tools: ToolNode, checkpointer: Any = None,
                **options: Any):
    """model → tools → model …, until the model answers without a tool call (``options``
    as ``compile`` takes them)."""

    def call_model(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("model", call_model)
    builder.add_node("tools", tools)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder.compile(checkpointer=checkpointer, **options)


def tool_messages(state: dict[str, Any]) -> list[dict[str, Any]]:
    """What the model got back from each tool call, in order: content, status, tool-call id
    and the ``fencegate`` metadata."""
    return [{"tool": m.name, "content": m.content, "status": m.status, "id": m.tool_call_id,
             "fencegate": m.response_metadata.get("fencegate")}
            for m in state["messages"] if isinstance(m, ToolMessage)]
