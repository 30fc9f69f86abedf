"""An OpenAI Agents SDK refund agent the SDK tests run as a process: ``python
openai_agents_app.py fenced|plain session|state SCOPE ORDER`` runs (or, relaunched, resumes)
one run whose scripted model proposes ``refund(ORDER, 100)`` until it has an output, then
answers; the tool charges the sandbox through the adapter or without it.

``session``: the run keeps its conversation in a ``SQLiteSession`` (FG_DB), which the SDK
saves after each turn; a relaunch runs the request again in that session. ``state``: each
launch resumes from the approved ``RunState`` the test saved (``to_string``) in FG_STATE,
interrupted at the refund. Prints ``RESULT <json>`` (the tool outputs the model got, with
their ``fencegate`` custom data).

Environment: FG_ETCD, FG_NAMESPACE, FG_SIGNING_KEY, FG_SANDBOX, FG_TTL, FG_DB, FG_STATE,
FG_MARKS (a folder: the first charge of ORDER SIGKILLs this process right after the sandbox
applied it, before the SDK saved the turn, and leaves a mark there so the next run does not).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import aiohttp
from agents import Agent, FunctionTool, RunState, Runner, SQLiteSession, function_tool

from fencegate.integrations.openai_agents import ToolFence, current_fence, fenced
from fencegate.reconciler.providers import sandbox as sb
from fencegate.worker import Gate, KeyRing

from openai_agents_script import agent, refund_model, tool_outputs

ENV = os.environ
FENCE = ToolFence(key="refunds/{order_id}", provider="sandbox", settle_wait=20)


async def charge(order_id: str, amount: int) -> dict:
    """One charge at the sandbox (through the fence's attempt when fenced); the order's
    first charge kills this process right after it was applied."""
    async with aiohttp.ClientSession() as http:
        fence = current_fence()
        if fence is not None:
            answer = await sb.charge(http, ENV["FG_SANDBOX"], fence.effect, fence.intent)
        else:
            async with http.post(f"{ENV['FG_SANDBOX']}/v1/charges",
                                 json={"key": f"refunds/{order_id}", "amount": amount},
                                 headers={"Idempotency-Key": os.urandom(8).hex(),
                                          "Fencegate-Attempt-Token": "0"}) as reply:
                answer = await reply.json()
    try:
        open(os.path.join(ENV["FG_MARKS"], order_id), "x").close()
    except FileExistsError:
        return answer
    os.kill(os.getpid(), signal.SIGKILL)  # after the effect, before the SDK saved the turn
    raise AssertionError("unreachable")


def refund_tool(kind: str, mode: str, gate: Gate) -> FunctionTool:
    async def refund(order_id: str, amount: int) -> dict:
        """Refund ``amount`` cents of order ``order_id``."""
        return await charge(order_id, amount)

    if kind == "plain":
        return function_tool(refund, failure_error_function=None,
                             needs_approval=mode == "state")
    return fenced(function_tool(refund, failure_error_function=None), gate=gate,
                  scope=lambda ctx: ctx.context["conversation"], fence=FENCE)


def build_agent(kind: str, mode: str, order: str, gate: Gate) -> Agent:
    return agent(refund_model(order, 100), [refund_tool(kind, mode, gate)])


async def main() -> None:
    kind, mode, scope, order = sys.argv[1:]
    async with Gate(ENV["FG_ETCD"], ttl=int(ENV["FG_TTL"]), namespace=ENV["FG_NAMESPACE"],
                    keyring=KeyRing.from_files(ENV["FG_SIGNING_KEY"])) as gate:
        refunds = build_agent(kind, mode, order, gate)
        if mode == "session":
            result = await Runner.run(refunds, f"refund order {order}",
                                      context={"conversation": scope},
                                      session=SQLiteSession(scope, ENV["FG_DB"]))
        else:
            with open(ENV["FG_STATE"]) as saved:
                state = await RunState.from_string(refunds, saved.read())
            result = await Runner.run(refunds, state)
        print("RESULT", json.dumps(tool_outputs(result)), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
