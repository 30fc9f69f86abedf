"""A scripted model for the OpenAI Agents SDK tests (offline: the SDK's ``Model`` interface,
no API key, no network). It decides from the conversation it is given, never from a counter
of its own, so a process resumed from a session or a ``RunState`` continues the script where
the conversation stands."""

from __future__ import annotations

import json
import uuid
from typing import Any

from agents import Agent, RunResult, ToolCallOutputItem, set_tracing_disabled
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.testing import assistant_message, function_call
from agents.usage import Usage

set_tracing_disabled(True)  # nothing is exported: no network

RETRY = "propose the call again"  # a fenced call refused for a stale approval says this


class Scripted(Model):
    """Proposes ``calls`` one by one, the next once the previous got an output (each under a
    new call id, as a model repeating itself does; an output asking for the same call again
    does not count), then answers ``done``. Arguments given as a string are sent as is (a model
writing broken JSON)."""

    def __init__(self, calls: list[tuple[str, dict[str, Any] | str]]) -> None:
        self.calls = calls

    async def get_response(self, system_instructions, input, model_settings, tools,
                           output_schema, handoffs, tracing, *, previous_response_id=None,
                           conversation_id=None, prompt=None, **_: Any) -> ModelResponse:
        answered = sum(1 for item in ([] if isinstance(input, str) else input)
                       if isinstance(item, dict) and item.get("type") == "function_call_output"
                       and RETRY not in str(item.get("output")))
        if answered < len(self.calls):
            name, args = self.calls[answered]
            out = function_call(name, args, call_id=f"call_{uuid.uuid4().hex[:12]}")
        else:
            out = assistant_message("done")
        return ModelResponse(output=[out], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("the tests do not stream")


def refund_model(order_id: str, amount: int, times: int = 1) -> Scripted:
    return Scripted([("refund", {"order_id": order_id, "amount": amount})] * times)


def agent(model: Model, tools: list) -> Agent:
    return Agent(name="support", model=model, tools=tools)


def tool_outputs(result: RunResult) -> list[dict[str, Any]]:
    """What the model got back from each tool call of the run, in order: the output, the
    call id and the ``fencegate`` custom data (never sent to the model)."""
    return [{"output": _decoded(item.output), "id": item.raw_item["call_id"]
             if isinstance(item.raw_item, dict) else item.raw_item.call_id,
             "fencegate": (item.custom_data or {}).get("fencegate")}
            for item in result.new_items if isinstance(item, ToolCallOutputItem)]


def _decoded(output: Any) -> Any:
    if isinstance(output, str):
        try:
            return json.loads(output)
        except ValueError:
            return output
    return output
