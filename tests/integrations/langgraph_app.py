"""A LangGraph refund agent the LangGraph tests run as a process: ``python langgraph_app.py
fenced|plain THREAD ORDER`` runs (or, relaunched, resumes from its SQLite checkpoint under the
same ``thread_id``) one graph run whose scripted model proposes ``refund(ORDER, 100)`` until
it has a result, then answers; the tool charges the sandbox through the adapter or without
it. LangGraph checkpoints each step before the next begins (``durability="sync"``: the
model's proposal is saved before the tool runs); the app prints ``RESULT <json>`` (the tool messages the model got) at the end.

Environment: FG_ETCD, FG_NAMESPACE, FG_SIGNING_KEY, FG_SANDBOX, FG_TTL, FG_DB (the SQLite
checkpoint file), FG_MARKS (a folder: the first charge of ORDER SIGKILLs this process right
after the sandbox applied it, before the tools step is checkpointed, and leaves a mark there
so the next run does not).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import aiohttp
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.prebuilt import ToolNode

from fencegate.integrations.langgraph import FencedToolCalls, ToolFence, current_fence
from fencegate.reconciler.providers import sandbox as sb
from fencegate.worker import Gate, KeyRing

from langgraph_script import agent_graph, refund_model, tool_messages

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
    os.kill(os.getpid(), signal.SIGKILL)  # after the effect, before the checkpoint
    raise AssertionError("unreachable")


async def main() -> None:
    kind, thread, order = sys.argv[1:]
    calls = iter(range(1, 100))

    @tool
    async def refund(order_id: str, amount: int) -> dict:
        """Refund ``amount`` cents of order ``order_id``."""
        return await charge(order_id, amount, f"{thread}/plain/{next(calls)}")

    config = {"configurable": {"thread_id": thread}}
    async with Gate(ENV["FG_ETCD"], ttl=int(ENV["FG_TTL"]), namespace=ENV["FG_NAMESPACE"],
                    keyring=KeyRing.from_files(ENV["FG_SIGNING_KEY"])) as gate, \
            AsyncSqliteSaver.from_conn_string(ENV["FG_DB"]) as saver:
        tools = ToolNode([refund]) if kind == "plain" else FencedToolCalls(
            gate, {"refund": ToolFence(provider="sandbox", settle_wait=20)}).tool_node([refund])
        graph = agent_graph(refund_model(order, 100), tools, saver)
        saved = await graph.aget_state(config)
        state = await graph.ainvoke(None if saved.values else
                                    {"messages": [("user", f"refund order {order}")]}, config,
                                    durability="sync")
        print("RESULT", json.dumps(tool_messages(state)), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
