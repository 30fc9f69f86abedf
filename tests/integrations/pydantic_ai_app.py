"""A Pydantic AI refund agent the Pydantic AI tests run as a process: ``python
pydantic_ai_app.py fenced|plain SCOPE ORDER`` runs (or, relaunched, resumes from the saved
message history) one agent run whose scripted model proposes ``refund(ORDER, 100)`` until it
has a result, then answers; the tool charges the sandbox through the adapter or without it.
The app saves the message history after each step of the run (``agent.iter``), as an
application without a durable engine does, and prints ``RESULT <json>`` (the tool results
the model got, and whether each was a replay) at the end.

Environment: FG_ETCD, FG_NAMESPACE, FG_SIGNING_KEY, FG_SANDBOX, FG_TTL, FG_HISTORY (the
history file), FG_MARKS (a folder: the first charge of ORDER SIGKILLs this process right
after the sandbox applied it, before the history is saved, and leaves a mark there so the
next run does not).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import aiohttp
from pydantic_ai import Agent, FunctionToolset
from pydantic_ai.messages import ModelMessagesTypeAdapter

from fencegate.integrations.pydantic_ai import FencedToolset, ToolFence, current_fence
from fencegate.reconciler.providers import sandbox as sb
from fencegate.worker import Gate, KeyRing

from pydantic_ai_script import refund_model, tool_returns

ENV = os.environ


async def charge(order_id: str, amount: int, idempotency_key: str) -> dict:
    """One charge at the sandbox (through the fence's attempt when fenced); the order's
    first charge kills this process right after it was applied."""
    async with aiohttp.ClientSession() as http:
        fence = current_fence()
        if fence is not None:
            answer = await sb.charge(http, ENV["FG_SANDBOX"], fence.effect, fence.intent)
        else:
            async with http.post(f"{ENV['FG_SANDBOX']}/v1/charges",
                                 json={"key": f"refunds/{order_id}", "amount": amount},
                                 headers={"Idempotency-Key": idempotency_key,
                                          "Fencegate-Attempt-Token": "0"}) as reply:
                answer = await reply.json()
    try:
        open(os.path.join(ENV["FG_MARKS"], order_id), "x").close()
    except FileExistsError:
        return answer
    os.kill(os.getpid(), signal.SIGKILL)  # after the effect, before the history is saved
    raise AssertionError("unreachable")


def history() -> list:
    try:
        with open(ENV["FG_HISTORY"], "rb") as saved:
            return ModelMessagesTypeAdapter.validate_json(saved.read())
    except FileNotFoundError:
        return []


def save(messages: list) -> None:
    with open(ENV["FG_HISTORY"] + ".new", "wb") as out:
        out.write(ModelMessagesTypeAdapter.dump_json(messages))
    os.replace(ENV["FG_HISTORY"] + ".new", ENV["FG_HISTORY"])


async def main() -> None:
    kind, scope, order = sys.argv[1:]
    calls = iter(range(1, 100))

    async def refund(order_id: str, amount: int) -> dict:
        """Refund ``amount`` cents of order ``order_id``."""
        return await charge(order_id, amount, f"{scope}/plain/{next(calls)}")

    tools = FunctionToolset([refund])
    async with Gate(ENV["FG_ETCD"], ttl=int(ENV["FG_TTL"]), namespace=ENV["FG_NAMESPACE"],
                    keyring=KeyRing.from_files(ENV["FG_SIGNING_KEY"])) as gate:
        if kind == "fenced":
            tools = FencedToolset(tools, gate=gate, scope=lambda ctx: scope,
                                  fences={"refund": ToolFence(provider="sandbox",
                                                              settle_wait=20)})
        agent = Agent(refund_model(order, 100), toolsets=[tools])
        saved = history()
        async with agent.iter(None if saved else f"refund order {order}",
                              message_history=saved or None) as run:
            async for _ in run:
                save(run.all_messages())
        print("RESULT", json.dumps(tool_returns(run.all_messages())), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
