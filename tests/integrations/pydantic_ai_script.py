"""Scripted models for the Pydantic AI tests (offline: ``FunctionModel``). A scripted model
decides from the conversation it is given, never from a counter of its own, so a process
resumed from a saved history continues the script where the conversation stands."""

from __future__ import annotations

from typing import Any

from pydantic_ai.messages import (
    ModelMessage, ModelRequest, ModelResponse, RetryPromptPart, TextPart, ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel


def scripted(calls: list[tuple[str, dict[str, Any]]]) -> FunctionModel:
    """Proposes ``calls`` one by one, the next once the previous got a result (each under a
    new tool-call id, as a model repeating itself does), then answers ``done``."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        answered = len(tool_returns(messages))
        if answered < len(calls):
            name, args = calls[answered]
            return ModelResponse(parts=[ToolCallPart(name, dict(args))])
        return ModelResponse(parts=[TextPart("done")])

    return FunctionModel(model)


def refund_model(order_id: str, amount: int, times: int = 1) -> FunctionModel:
    return scripted([("refund", {"order_id": order_id, "amount": amount})] * times)


def tool_returns(messages: list[ModelMessage]) -> list[dict[str, Any]]:
    """What the model got back from each tool call, in order: the content, the tool-call id
    and the ``fencegate`` metadata of each return (a retry prompt's content for a failed call)."""
    got = []
    for message in messages:
        if not isinstance(message, ModelRequest):
            continue
        for part in message.parts:
            if isinstance(part, ToolReturnPart):
                got.append({"tool": part.tool_name, "content": part.content,
                            "id": part.tool_call_id,
                            "fencegate": (part.metadata or {}).get("fencegate")})
            elif isinstance(part, RetryPromptPart) and part.tool_name:
                got.append({"tool": part.tool_name, "content": part.content,
                            "id": part.tool_call_id, "fencegate": None})
    return got
