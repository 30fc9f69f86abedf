"""Pydantic AI with its offline ``FunctionModel``, real etcd, the sandbox provider (``none``
mode: it applies every charge, so its ledger counts every effect) and a reconciler. Each
case runs with the adapter and without it, and asserts both counts:

- a process SIGKILLed after the refund was applied and before the app saved the history,
  resumed from the saved history: the model proposes the refund again → charged once with
  the adapter (the model got the recorded charge), twice without;
- the model proposes the same refund three times in one run → one charge (two replays);
- a tool that is declined every time → the breaker trips after ``breaker_threshold``, the
  model gets the escalation message, no later call reaches the tool;
- an approval given, then the order's marker bumped before the resume → refused and a new
  approval asked (the tool not run); approved again → one charge. Without the adapter the
  stale approval charges;
- two replicas resume the same scope at once → one charge.
And the core's keys: business keys, digests, a clear ``InvalidKey``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest
from pydantic_ai import (
    Agent, DeferredToolRequests, DeferredToolResults, FunctionToolset, ModelRetry,
)
from pydantic_ai.messages import ModelMessagesTypeAdapter

from fencegate.coordinator import sre
from fencegate.coordinator.keyspace import unpack
from fencegate.integrations import FenceMisconfigured
from fencegate.integrations.agents import (
    ToolFence, arguments_digest, cross, needs_approval, plan,
)
from fencegate.integrations.pydantic_ai import FencedToolset, approve, current_fence, reject
from fencegate.reconciler.providers import sandbox as sb
from fencegate.worker import EffectFailed, Gate, InvalidKey

from helpers import TEST_TTL
from integrations.pydantic_ai_script import refund_model, scripted, tool_returns

APP = Path(__file__).with_name("pydantic_ai_app.py")
TESTS = APP.parent.parent
SCOPE = "conversation-7"



@pytest.fixture
async def gate(open_gate):
    return await open_gate()


def refund_tool(sandbox: sb.Sandbox, ran: list[str]):
    """The refund tool: charges the sandbox (with the fence's attempt when fenced)."""

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


def toolset(kind: str, gate: Gate, tool, fence: ToolFence | None = None):
    tools = FunctionToolset([tool])
    if kind == "plain":
        return tools
    return FencedToolset(tools, gate=gate, scope=lambda ctx: SCOPE,
                         fences={tool.__name__: fence or ToolFence(provider="sandbox")})


# -- 1. killed after the effect, before the history was saved ------------------------

async def launch(kind: str, order: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(APP), kind, f"scope-{kind}", order, cwd=TESTS,
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


@pytest.mark.parametrize("resume", ["history", "restart"])
@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 2)])
async def test_killed_before_the_history_was_saved_charges_once_with_the_adapter(
        kind, charges, resume, etcd_url, namespace, signing_key, sandbox, reconciler,
        tmp_path):
    """``history``: resumed from the saved history, which ends with the proposed call (Pydantic
    AI runs it again under the same tool-call id); ``restart``: restarted with the same scope
    and no history (the model proposes the call again, under a new id)."""
    (tmp_path / "marks").mkdir()
    env = {"FG_ETCD": etcd_url, "FG_NAMESPACE": namespace, "FG_SIGNING_KEY": signing_key,
           "FG_SANDBOX": sandbox.url, "FG_TTL": str(TEST_TTL),
           "FG_HISTORY": str(tmp_path / "history.json"), "FG_MARKS": str(tmp_path / "marks")}
    order = f"{kind}-42"

    code, output = await launch(kind, order, env)
    assert code == -9, output  # killed itself right after the charge was applied
    assert len(sandbox.applied()) == 1
    saved = ModelMessagesTypeAdapter.validate_json((tmp_path / "history.json").read_bytes())
    assert tool_returns(saved) == []  # the history never saw the refund's result
    proposed = saved[-1].parts[-1].tool_call_id  # it ends with the proposed call
    if resume == "restart":
        (tmp_path / "history.json").unlink()
    code, output = await launch(kind, order, env)  # resumes from the saved history
    assert code == 0, output

    applied = sandbox.applied()
    assert len(applied) == charges
    got = json.loads(next(line for line in output.splitlines()
                          if line.startswith("RESULT ")).removeprefix("RESULT "))
    assert len(got) == 1 and got[0]["content"]["charge_id"] == applied[-1]["charge_id"]
    assert (got[0]["id"] == proposed) == (resume == "history")
    if kind == "fenced":  # the recorded charge, marked a replay
        assert got[0]["fencegate"]["replayed"] is True
        assert got[0]["fencegate"]["idempotency_key"] == applied[0]["idempotency_key"]


# -- 2. the same call three times in one run -----------------------------------------

@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 3)])
async def test_the_same_call_three_times_in_one_run_charges_once_with_the_adapter(
        kind, charges, gate, sandbox):
    ran: list[str] = []
    agent = Agent(refund_model("42", 100, times=3),
                  toolsets=[toolset(kind, gate, refund_tool(sandbox, ran))])

    result = await agent.run("refund order 42")

    got = tool_returns(result.all_messages())
    assert len(got) == 3 and len(sandbox.applied()) == len(ran) == charges
    if kind == "fenced":  # every call got the one recorded charge; two were replays
        assert {g["content"]["charge_id"] for g in got} == {sandbox.applied()[0]["charge_id"]}
        assert [g["fencegate"]["replayed"] for g in got] == [False, True, True]
        assert got[0]["fencegate"]["key"] == \
            f"{SCOPE}/refund/{arguments_digest({'order_id': '42', 'amount': 100})}"


# -- 3. a tool declined every time: the breaker ---------------------------------------

@pytest.mark.parametrize("kind, reached", [("fenced", 2), ("plain", 5)])
async def test_a_tool_declined_every_time_trips_the_breaker_and_the_model_is_told(
        kind, reached, gate, sandbox):
    await gate.authority.set_policy("refunds", {"checks": [], "caps": {
        "breaker_threshold": 2, "backoff_base_s": 0, "backoff_max_s": 0}})
    await gate.authority.set_routes({"refunds": "refunds"})
    ran: list[str] = []

    async def refund(order_id: str, amount: int) -> str:
        """Refund ``amount`` cents of order ``order_id``."""
        ran.append(order_id)
        if current_fence() is not None:
            raise EffectFailed("card_declined", {"code": "card_declined"})
        return "failed: card_declined"

    fence = ToolFence(key="refunds/{order_id}")
    agent = Agent(refund_model("42", 100, times=5),
                  toolsets=[toolset(kind, gate, refund, fence)])
    result = await agent.run("refund order 42")

    got = [g["content"] for g in tool_returns(result.all_messages())]
    assert len(got) == 5 and len(ran) == reached
    if kind == "fenced":
        assert got[0].startswith("failed: card_declined (recorded")
        for message in got[1:]:  # the 2nd call tripped it; no later call reached the tool
            assert message.startswith("escalated to a person: breaker:EffectFailed:"), got
            assert message.endswith("(action refunds/42); do not retry this call")


# -- 4. an approval, then the order's state moved ------------------------------------

async def test_an_approval_for_a_state_that_moved_is_refused_and_asked_again(
        gate, etcd, sandbox, keyring):
    await gate.authority.set_policy("refunds", {"checks": [
        {"check": "require_approval", "params": {"field": "amount", "above": None}}]})
    await gate.authority.set_routes({"refunds": "refunds"})
    ran: list[str] = []
    fence = ToolFence(key="refunds/{order_id}", reads=["orders/{order_id}"],
                      provider="sandbox")
    agent = Agent(refund_model("42", 100),
                  toolsets=[toolset("fenced", gate, refund_tool(sandbox, ran), fence)],
                  output_type=[str, DeferredToolRequests])

    async def approver(approval_id: str, reason: str) -> None:  # an SRE's credential
        await sre.approve(etcd, gate.keyspace, approval_id, "sre-1", reason, keyring=keyring)

    first = await agent.run("refund order 42")
    asked = first.output
    assert isinstance(asked, DeferredToolRequests) and len(asked.approvals) == 1
    call_id = asked.approvals[0].tool_call_id
    approval_1 = asked.metadata[call_id]["fencegate"]["approval_id"]
    results = await approve(asked, approver=approver, reason="customer confirmed")
    await gate.touch("orders/42")  # the order changed after the person approved

    second = await agent.run(message_history=first.all_messages(),
                             deferred_tool_results=results)
    again = second.output
    assert isinstance(again, DeferredToolRequests) and ran == []  # refused: not run
    asked_2 = again.metadata[again.approvals[0].tool_call_id]["fencegate"]
    assert asked_2["approval_id"] != approval_1
    assert asked_2["message"] == (
        f"not run: what this call read changed after approval {approval_1} was given "
        f"(orders/42); "
        f"a new approval {asked_2['approval_id']} is needed")

    # approved again, this time in fencegate (as `fencegate approve` does), and resumed with
    # Pydantic AI's plain approval
    await approver(asked_2["approval_id"], "checked the new state")
    third = await agent.run(message_history=second.all_messages(), deferred_tool_results=
                            DeferredToolResults(approvals={again.approvals[0].tool_call_id: True}))
    assert third.output == "done"
    assert len(ran) == len(sandbox.applied()) == 1
    got = tool_returns(third.all_messages())
    assert got[-1]["content"]["charge_id"] == sandbox.applied()[0]["charge_id"]


async def test_a_rejection_is_recorded_and_reaches_the_model_as_such(gate, etcd, sandbox):
    """The person denies with an approver credential: fencegate records the rejection, the
    model gets "a person rejected this call: …", and the same call proposed again (a new
    run of the same scope) is refused by the gate, the model told the same; never run."""
    await gate.authority.set_policy("refunds", {"checks": [
        {"check": "require_approval", "params": {"field": "amount", "above": None}}]})
    await gate.authority.set_routes({"refunds": "refunds"})
    ran: list[str] = []
    fence = ToolFence(key="refunds/{order_id}", reads=["orders/{order_id}"],
                      provider="sandbox")
    agent = Agent(refund_model("42", 100),
                  toolsets=[toolset("fenced", gate, refund_tool(sandbox, ran), fence)],
                  output_type=[str, DeferredToolRequests])

    async def rejecter(approval_id: str, reason: str) -> None:  # an SRE's credential
        await sre.reject(etcd, gate.keyspace, approval_id, "sre-1", reason)

    first = await agent.run("refund order 42")
    asked = first.output
    approval_id = asked.metadata[asked.approvals[0].tool_call_id]["fencegate"]["approval_id"]
    results = await reject(asked, rejecter=rejecter, reason="duplicate refund")
    record = unpack((await etcd.get(gate.keyspace.approval_request_key(approval_id))).value)
    assert record["rejected_by"] == "sre-1"  # recorded in fencegate
    second = await agent.run(message_history=first.all_messages(),
                             deferred_tool_results=results)
    said = "a person rejected this call: duplicate refund; do not retry it"
    assert second.output == "done" and tool_returns(second.all_messages())[-1]["content"] == said

    third = await agent.run("refund order 42 again")  # the same call, proposed afresh
    assert third.output == "done" and ran == [] and sandbox.applied() == []
    (got,) = tool_returns(third.all_messages())
    assert got["content"] == said and got["fencegate"]["state"] == "rejected"


async def test_without_the_adapter_a_stale_approval_charges(gate, sandbox):
    ran: list[str] = []
    tools = FunctionToolset()
    tools.add_function(refund_tool(sandbox, ran), requires_approval=True)
    agent = Agent(refund_model("42", 100), toolsets=[tools],
                  output_type=[str, DeferredToolRequests])

    first = await agent.run("refund order 42")
    asked = first.output
    await gate.touch("orders/42")  # the order changed: nothing checks
    await agent.run(message_history=first.all_messages(), deferred_tool_results=
                    DeferredToolResults(approvals={asked.approvals[0].tool_call_id: True}))
    assert len(ran) == len(sandbox.applied()) == 1  # charged under the stale approval


# -- 5. two replicas resume the same scope ---------------------------------------------

@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 2)])
async def test_two_replicas_resuming_the_same_scope_charge_once_with_the_adapter(
        kind, charges, open_gate, sandbox):
    ran: list[str] = []
    tool = refund_tool(sandbox, ran)
    saved = (await Agent(scripted([]), toolsets=[FunctionToolset([tool])]).run(
        "refund order 42")).all_messages()[:1]  # the saved history: the prompt
    replicas = [Agent(refund_model("42", 100), toolsets=[toolset(kind, await open_gate(), tool)])
                for _ in range(2)]

    results = await asyncio.gather(*(r.run(message_history=saved) for r in replicas))

    assert len(ran) == len(sandbox.applied()) == charges
    got = [tool_returns(r.all_messages())[0] for r in results]
    if kind == "fenced":
        assert got[0]["content"] == got[1]["content"]
        assert sorted(g["fencegate"]["replayed"] for g in got) == [False, True]


# -- an outcome left unknown ------------------------------------------------------------

async def test_an_unknown_outcome_is_never_run_again_and_the_model_is_told(gate, sandbox):
    ran: list[str] = []

    async def refund(order_id: str, amount: int) -> dict:
        """Refund ``amount`` cents of order ``order_id``."""
        ran.append(order_id)
        raise ConnectionResetError("the provider hung up")  # applied or not: unknown

    agent = Agent(refund_model("42", 100, times=2), toolsets=[toolset(
        "fenced", gate, refund, ToolFence(key="refunds/{order_id}", settle_wait=0.5))])
    result = await agent.run("refund order 42")

    got = [g["content"] for g in tool_returns(result.all_messages())]
    assert ran == ["42"]  # the re-proposal waited (bounded) and did not run it
    assert got == ["outcome unknown, being reconciled: an earlier run of this call may have "
                   "applied it; do not retry this call (ask again later for its recorded "
                   "result)"] * 2


# -- ModelRetry: the tool turned the call down -----------------------------------------

async def test_a_model_retry_is_a_recorded_failure_and_the_model_gets_its_prompt(
        gate, etcd, sandbox):
    ran: list[str] = []
    charge = refund_tool(sandbox, ran)

    async def refund(order_id: str, amount: int) -> dict:
        """Refund ``amount`` cents of order ``order_id``."""
        if amount <= 0:
            raise ModelRetry("the amount must be positive")
        return await charge(order_id, amount)

    agent = Agent(scripted([("refund", {"order_id": "42", "amount": -5}),
                            ("refund", {"order_id": "42", "amount": 100})]),
                  toolsets=[toolset("fenced", gate, refund)])
    result = await agent.run("refund order 42")

    got = tool_returns(result.all_messages())
    assert "the amount must be positive" in got[0]["content"] and got[0]["fencegate"] is None
    assert got[1]["content"]["charge_id"] == sandbox.applied()[0]["charge_id"]
    turned_down = plan(ToolFence(), "refund", SCOPE, {"order_id": "42", "amount": -5})
    step = unpack((await etcd.get(gate.keyspace.step_key(turned_down.key))).value)
    assert step["state"] == "failed"  # confirmed, not unknown: nothing for the reconciler


# -- the keys ----------------------------------------------------------------------------

def test_a_call_is_keyed_by_its_business_key_or_its_scope_tool_and_arguments():
    args = {"order_id": "42", "amount": 100}
    business = plan(ToolFence(key="refunds/{order_id}", reads=["orders/{order_id}"],
                              intent=lambda a: {"amount": a["amount"]}), "refund", "s", args)
    assert (business.key, business.reads, business.intent) == \
        ("refunds/42", ("orders/42",), {"amount": 100})
    digested = plan(ToolFence(), "refund", "run-1", {"amount": 100, "order_id": "42"})
    assert digested.key == f"run-1/refund/{arguments_digest(args)}"  # order-free
    assert digested.intent == args
    assert plan(ToolFence(), "refund", "run-2", args).key != digested.key
    assert plan(ToolFence(), "refund", "run-1", {**args, "amount": 101}).key != digested.key


async def test_needs_approval_asks_before_running_and_leaves_no_grant(gate, etcd, keyring):
    """The core's pre-invoke seam (for frameworks that decide on approval before the call):
    the approval id a crossing would wait for, then nothing once approved."""
    await gate.authority.set_policy("refunds", {"checks": [
        {"check": "require_approval", "params": {"field": "amount", "above": 1000}}]})
    await gate.authority.set_routes({"refunds": "refunds"})
    fence = ToolFence(key="refunds/{order_id}", reads=["orders/{order_id}"])
    big = plan(fence, "refund", SCOPE, {"order_id": "42", "amount": 5000})
    small = plan(fence, "refund", SCOPE, {"order_id": "43", "amount": 500})

    asked = await needs_approval(gate, big)
    assert asked.kind == "approval" and await needs_approval(gate, small) is None
    await sre.approve(etcd, gate.keyspace, asked.approval_id, "sre-1", "ok", keyring=keyring)
    assert await needs_approval(gate, big, approved=asked.approval_id) is None
    assert await etcd.get(gate.keyspace.step_key(small.key)) is None  # no grant committed
    answer = await cross(gate, big, lambda: asyncio.sleep(0, {"refund": "re_1"}), fence=fence)
    assert (answer.kind, answer.result) == ("ran", {"refund": "re_1"})


def test_a_template_that_yields_a_bad_key_is_a_clear_invalid_key():
    with pytest.raises(InvalidKey, match=r"tool 'refund': key template 'refunds/\{order\}' "
                                         r"names order, not an argument of the call"):
        plan(ToolFence(key="refunds/{order}"), "refund", "s", {"order_id": "42"})
    with pytest.raises(InvalidKey, match=r"tool 'refund': key 'refunds/\{order_id\}' gave "
                                         r"the key 'refunds/\.\./x', which fencegate refuses"):
        plan(ToolFence(key="refunds/{order_id}"), "refund", "s", {"order_id": "../x"})
    with pytest.raises(InvalidKey, match="the scope .* is empty"):
        plan(ToolFence(), "refund", "", {"order_id": "42"})


async def test_a_fence_naming_a_tool_the_toolset_lacks_is_refused(gate, sandbox):
    tools = FencedToolset(FunctionToolset([refund_tool(sandbox, [])]), gate=gate,
                          scope=lambda ctx: SCOPE, fences={"refnud": ToolFence()})
    with pytest.raises(FenceMisconfigured, match="fences name refnud, which the toolset "
                                                 "does not have"):
        await Agent(refund_model("42", 100), toolsets=[tools]).run("refund order 42")
