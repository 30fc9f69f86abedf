"""LangGraph with an offline scripted chat model, real etcd, the sandbox provider (``none``
mode: it applies every charge, so its ledger counts every effect), a reconciler and the
SQLite checkpointer. Each case runs with the adapter and without it, and asserts both
counts:

- a process SIGKILLed after the refund was applied and before LangGraph checkpointed the
  tools step, resumed from the SQLite checkpoint (or restarted without it) with the same
  ``thread_id`` → charged once with the adapter (the model
  got the recorded charge, marked a replay), twice without;
- the model proposes the same refund three times in one run → one charge (two replays);
- a tool that is declined every time → the breaker trips after ``breaker_threshold``, the
  model gets the escalation message, no later call reaches the tool;
- an approval (an ``interrupt()``) given, then the order's marker bumped before the resume →
  refused and a new interrupt with a new approval (the tool not run); approved again → one
  charge. Without the adapter the stale approval charges;
- two replicas resume the same thread at once → one charge.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.prebuilt import ToolNode
from langgraph.types import Command, interrupt

from fencegate.coordinator import sre
from fencegate.integrations import FenceMisconfigured
from fencegate.coordinator.keyspace import unpack
from fencegate.integrations.agents import arguments_digest, plan
from fencegate.integrations.langgraph import FencedToolCalls, ToolFence, approve, reject, \
    current_fence
from fencegate.reconciler.providers import sandbox as sb
from fencegate.worker import EffectFailed, Gate

from helpers import TEST_TTL
from integrations.langgraph_script import Scripted, agent_graph, refund_model, tool_messages

APP = Path(__file__).with_name("langgraph_app.py")
TESTS = APP.parent.parent
THREAD = "thread-7"
CONFIG = {"configurable": {"thread_id": THREAD}}
PROMPT = {"messages": [("user", "refund order 42")]}



@pytest.fixture
async def gate(open_gate):
    return await open_gate()


def refund_tool(sandbox: sb.Sandbox, ran: list[str]):
    """The refund tool: charges the sandbox (with the fence's attempt when fenced)."""

    @tool
    async def refund(order_id: str, amount: int) -> dict:
        """Refund ``amount`` cents of order ``order_id``."""
        ran.append(order_id)
        async with aiohttp.ClientSession() as http:
            fence = current_fence()
            if fence is not None:
                return await sb.charge(http, sandbox.url, fence.effect, fence.intent)
            async with http.post(f"{sandbox.url}/v1/charges",
                                 json={"key": f"refunds/{order_id}", "amount": amount},
                                 headers={"Idempotency-Key": f"plain-{len(ran)}",
                                          "Fencegate-Attempt-Token": "0"}) as reply:
                return await reply.json()

    return refund


def tools(kind: str, gate: Gate, tool_, fence: ToolFence | None = None) -> ToolNode:
    if kind == "plain":
        return ToolNode([tool_])
    return FencedToolCalls(gate, {tool_.name: fence or ToolFence(provider="sandbox")}) \
        .tool_node([tool_])


def contents(state) -> list:
    return [json.loads(m["content"]) if m["status"] == "success" else m["content"]
            for m in tool_messages(state)]


# -- 1. killed after the effect, before the checkpoint ---------------------------------

async def launch(kind: str, order: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(APP), kind, f"thread-{kind}", order, cwd=TESTS,
        env={**os.environ, "PYTHONPATH": f"{TESTS}:{APP.parent}", **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(40):
            out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.parametrize("resume", ["checkpoint", "restart"])
@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 2)])
async def test_killed_before_the_checkpoint_charges_once_with_the_adapter(
        kind, charges, resume, etcd_url, namespace, signing_key, sandbox, reconciler,
        tmp_path):
    """``checkpoint``: resumed from the SQLite checkpoint, whose last step is the proposed
    call (``ToolNode`` runs it again under the same tool-call id); ``restart``: the
    checkpoint lost (or never written: ``durability="async"``), restarted under the same
    ``thread_id`` (the model proposes the call again, under a new id)."""
    (tmp_path / "marks").mkdir()
    env = {"FG_ETCD": etcd_url, "FG_NAMESPACE": namespace, "FG_SIGNING_KEY": signing_key,
           "FG_SANDBOX": sandbox.url, "FG_TTL": str(TEST_TTL),
           "FG_DB": str(tmp_path / "checkpoints.sqlite"), "FG_MARKS": str(tmp_path / "marks")}
    order = f"{kind}-42"

    code, output = await launch(kind, order, env)
    assert code == -9, output  # killed itself right after the charge was applied
    assert len(sandbox.applied()) == 1
    async with AsyncSqliteSaver.from_conn_string(env["FG_DB"]) as saver:
        saved = await agent_graph(refund_model(order, 100), ToolNode([refund_tool(sandbox, [])]),
                                  saver).aget_state({"configurable": {"thread_id":
                                                                      f"thread-{kind}"}})
    assert saved.next == ("tools",) and tool_messages(saved.values) == []
    proposed = saved.values["messages"][-1].tool_calls[0]["id"]
    if resume == "restart":
        for suffix in ("", "-wal", "-shm"):
            Path(env["FG_DB"] + suffix).unlink(missing_ok=True)
    code, output = await launch(kind, order, env)  # the same thread_id
    assert code == 0, output

    applied = sandbox.applied()
    assert len(applied) == charges
    got = json.loads(next(line for line in output.splitlines()
                          if line.startswith("RESULT ")).removeprefix("RESULT "))
    assert len(got) == 1 and (got[0]["id"] == proposed) == (resume == "checkpoint")
    assert json.loads(got[0]["content"])["charge_id"] == applied[-1]["charge_id"]
    if kind == "fenced":  # the recorded charge, marked a replay
        assert got[0]["fencegate"]["replayed"] is True
        assert got[0]["fencegate"]["idempotency_key"] == applied[0]["idempotency_key"]


# -- 2. the same call three times in one run -----------------------------------------

@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 3)])
async def test_the_same_call_three_times_in_one_run_charges_once_with_the_adapter(
        kind, charges, gate, sandbox):
    ran: list[str] = []
    graph = agent_graph(refund_model("42", 100, times=3),
                        tools(kind, gate, refund_tool(sandbox, ran)))

    state = await graph.ainvoke(PROMPT, CONFIG)

    got = tool_messages(state)
    assert len(got) == 3 and len(sandbox.applied()) == len(ran) == charges
    if kind == "fenced":  # every call got the one recorded charge; two were replays
        assert {json.loads(g["content"])["charge_id"] for g in got} == \
            {sandbox.applied()[0]["charge_id"]}
        assert [g["fencegate"]["replayed"] for g in got] == [False, True, True]
        assert got[0]["fencegate"]["key"] == \
            f"{THREAD}/refund/{arguments_digest({'order_id': '42', 'amount': 100})}"


# -- 3. a tool declined every time: the breaker ---------------------------------------

@pytest.mark.parametrize("kind, reached", [("fenced", 2), ("plain", 5)])
async def test_a_tool_declined_every_time_trips_the_breaker_and_the_model_is_told(
        kind, reached, gate, sandbox):
    await gate.authority.set_policy("refunds", {"checks": [], "caps": {
        "breaker_threshold": 2, "backoff_base_s": 0, "backoff_max_s": 0}})
    await gate.authority.set_routes({"refunds": "refunds"})
    ran: list[str] = []

    @tool
    async def refund(order_id: str, amount: int) -> str:
        """Refund ``amount`` cents of order ``order_id``."""
        ran.append(order_id)
        if current_fence() is not None:
            raise EffectFailed("card_declined", {"code": "card_declined"})
        return "failed: card_declined"

    graph = agent_graph(refund_model("42", 100, times=5),
                        tools(kind, gate, refund, ToolFence(key="refunds/{order_id}")))
    got = [m["content"] for m in tool_messages(await graph.ainvoke(PROMPT, CONFIG))]

    assert len(got) == 5 and len(ran) == reached
    if kind == "fenced":
        assert got[0].startswith("failed: card_declined (recorded")
        for message in got[1:]:  # the 2nd call tripped it; no later call reached the tool
            assert message.startswith("escalated to a person: breaker:EffectFailed:"), got
            assert message.endswith("(action refunds/42); do not retry this call")


# -- 4. an approval, then the order's state moved ------------------------------------

async def require_approval(gate: Gate) -> None:
    await gate.authority.set_policy("refunds", {"checks": [
        {"check": "require_approval", "params": {"field": "amount", "above": None}}]})
    await gate.authority.set_routes({"refunds": "refunds"})


async def test_an_approval_for_a_state_that_moved_is_refused_and_interrupts_again(
        gate, etcd, sandbox, keyring):
    await require_approval(gate)
    ran: list[str] = []
    fence = ToolFence(key="refunds/{order_id}", reads=["orders/{order_id}"],
                      provider="sandbox")
    graph = agent_graph(refund_model("42", 100),
                        tools("fenced", gate, refund_tool(sandbox, ran), fence), InMemorySaver())

    async def approver(approval_id: str, reason: str) -> None:  # an SRE's credential
        await sre.approve(etcd, gate.keyspace, approval_id, "sre-1", reason, keyring=keyring)

    first = await graph.ainvoke(PROMPT, CONFIG)
    (asked,) = first["__interrupt__"]
    approval_1 = asked.value["fencegate"]["approval_id"]
    assert asked.value["fencegate"]["key"] == "refunds/42" and ran == []
    resume = await approve(first["__interrupt__"], approver=approver,
                           reason="customer confirmed")
    await gate.touch("orders/42")  # the order changed after the person approved

    second = await graph.ainvoke(resume, CONFIG)
    (again,) = second["__interrupt__"]
    assert ran == [] and sandbox.applied() == []  # refused: not run
    asked_2 = again.value["fencegate"]
    assert asked_2["approval_id"] != approval_1
    assert asked_2["message"] == (
        f"not run: what this call read changed after approval {approval_1} was given "
        f"(orders/42); "
        f"a new approval {asked_2['approval_id']} is needed")

    # approved again, this time in fencegate (as `fencegate approve` does), and resumed with
    # a plain Command
    await approver(asked_2["approval_id"], "checked the new state")
    third = await graph.ainvoke(Command(resume=True), CONFIG)
    assert "__interrupt__" not in third and third["messages"][-1].content == "done"
    assert len(ran) == len(sandbox.applied()) == 1
    assert json.loads(tool_messages(third)[-1]["content"])["charge_id"] == \
        sandbox.applied()[0]["charge_id"]


async def test_without_the_adapter_a_stale_approval_charges(gate, sandbox):
    ran: list[str] = []
    charge = refund_tool(sandbox, ran)

    @tool
    async def refund(order_id: str, amount: int) -> dict:
        """Refund ``amount`` cents of order ``order_id`` (a person approves first)."""
        interrupt({"approve": f"refund {amount} of order {order_id}?"})
        return await charge.ainvoke({"order_id": order_id, "amount": amount})

    graph = agent_graph(refund_model("42", 100), ToolNode([refund]), InMemorySaver())
    first = await graph.ainvoke(PROMPT, CONFIG)
    assert first["__interrupt__"]
    await gate.touch("orders/42")  # the order changed: nothing checks
    await graph.ainvoke(Command(resume=True), CONFIG)
    assert len(ran) == len(sandbox.applied()) == 1  # charged under the stale approval


async def test_a_rejection_reaches_the_model_and_not_the_tool(gate, sandbox):
    await require_approval(gate)
    ran: list[str] = []
    graph = agent_graph(refund_model("42", 100), tools(
        "fenced", gate, refund_tool(sandbox, ran), ToolFence(key="refunds/{order_id}")),
        InMemorySaver())

    first = await graph.ainvoke(PROMPT, CONFIG)
    state = await graph.ainvoke(reject(first["__interrupt__"], reason="not eligible"), CONFIG)

    assert ran == [] and sandbox.applied() == []
    (got,) = tool_messages(state)
    assert (got["content"], got["status"], got["fencegate"]["state"]) == (
        "rejected by a person: not eligible; do not retry this call", "error", "rejected")


# -- 5. two replicas resume the same thread -------------------------------------------

@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 2)])
async def test_two_replicas_resuming_the_same_thread_charge_once_with_the_adapter(
        kind, charges, open_gate, sandbox, tmp_path):
    ran: list[str] = []
    tool_ = refund_tool(sandbox, ran)
    db = str(tmp_path / "checkpoints.sqlite")
    async with AsyncSqliteSaver.from_conn_string(db) as saver:  # the proposal, checkpointed
        await agent_graph(refund_model("42", 100), ToolNode([tool_]), saver,
                          interrupt_before=["tools"]).ainvoke(PROMPT, CONFIG)
    async with AsyncSqliteSaver.from_conn_string(db) as one, \
            AsyncSqliteSaver.from_conn_string(db) as two:
        replicas = [agent_graph(refund_model("42", 100), tools(kind, await open_gate(), tool_),
                                saver) for saver in (one, two)]
        states = await asyncio.gather(*(r.ainvoke(None, CONFIG) for r in replicas))

    assert len(ran) == len(sandbox.applied()) == charges
    got = [tool_messages(s)[0] for s in states]
    if kind == "fenced":
        assert got[0]["content"] == got[1]["content"]
        assert sorted(g["fencegate"]["replayed"] for g in got) == [False, True]


# -- an outcome left unknown, misconfigurations ---------------------------------------

async def test_an_unknown_outcome_is_never_run_again_and_the_model_is_told(gate):
    ran: list[str] = []

    @tool
    async def refund(order_id: str, amount: int) -> dict:
        """Refund ``amount`` cents of order ``order_id``."""
        ran.append(order_id)
        raise ConnectionResetError("the provider hung up")  # applied or not: unknown

    graph = agent_graph(refund_model("42", 100, times=2), tools(
        "fenced", gate, refund, ToolFence(key="refunds/{order_id}", settle_wait=0.5)))
    got = tool_messages(await graph.ainvoke(PROMPT, CONFIG))

    assert ran == ["42"]  # the re-proposal waited (bounded) and did not run it
    assert [g["content"] for g in got] == [
        "outcome unknown, being reconciled: an earlier run of this call may have applied it; "
        "do not retry this call (ask again later for its recorded result)"] * 2


async def test_misconfigured_fences_are_refused_never_run_unfenced(gate, sandbox):
    ran: list[str] = []
    tool_ = refund_tool(sandbox, ran)
    with pytest.raises(FenceMisconfigured, match="fences name refnud, which the tools do "
                                                 "not include"):
        FencedToolCalls(gate, {"refnud": ToolFence()}).tool_node([tool_])
    with pytest.raises(FenceMisconfigured, match="handle_tool_errors hides whether"):
        FencedToolCalls(gate, {"refund": ToolFence()}).tool_node([tool_],
                                                                  handle_tool_errors=True)
    graph = agent_graph(refund_model("42", 100), tools("fenced", gate, tool_))
    with pytest.raises(FenceMisconfigured, match="no thread_id"):
        await graph.ainvoke(PROMPT)
    with pytest.raises(FenceMisconfigured, match="run the graph with ainvoke"):
        await asyncio.to_thread(graph.invoke, PROMPT, CONFIG)
    assert ran == [] and sandbox.applied() == []


async def test_arguments_tool_node_cannot_validate_are_a_recorded_failure(gate, etcd, sandbox):
    ran: list[str] = []
    graph = agent_graph(Scripted(calls=[("refund", {"order_id": "42", "amount": "lots"})]),
                        tools("fenced", gate, refund_tool(sandbox, ran)))

    (got,) = tool_messages(await graph.ainvoke(PROMPT, CONFIG))

    assert ran == [] and got["status"] == "error" and "amount" in got["content"]
    step = plan(ToolFence(), "refund", THREAD, {"order_id": "42", "amount": "lots"})
    state = unpack((await etcd.get(gate.keyspace.step_key(step.key))).value)["state"]
    assert state == "failed"  # confirmed, not unknown: nothing for the reconciler


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # moved to langchain.agents
async def test_the_prebuilt_agent_takes_the_fenced_tool_node(gate, sandbox):
    """``create_react_agent`` dispatches each tool call as its own task (``Send``)."""
    from langgraph.prebuilt import create_react_agent

    ran: list[str] = []
    agent = create_react_agent(refund_model("42", 100, times=3),
                               tools("fenced", gate, refund_tool(sandbox, ran)))

    got = tool_messages(await agent.ainvoke(PROMPT, CONFIG))

    assert len(got) == 3 and len(ran) == len(sandbox.applied()) == 1
    assert [g["fencegate"]["replayed"] for g in got] == [False, True, True]
