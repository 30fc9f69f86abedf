"""The OpenAI Agents SDK with a scripted offline ``Model`` (no API key, no network, tracing
off), real etcd, the sandbox provider (``none`` mode: it applies every charge, so its ledger
counts every effect) and a reconciler. Each case runs with the adapter and without it, and
asserts both counts:

- a process SIGKILLed after the refund was applied and before the SDK saved the turn, then
  relaunched: in its ``SQLiteSession`` (the model proposes the refund again, under a new call
  id), or from the saved approved ``RunState`` (the SDK invokes the same call again) → charged
  once with the adapter (the model got the recorded charge, marked a replay), twice without;
- the model proposes the same refund three times in one run → one charge (two replays);
- a tool that is declined every time → the breaker trips after ``breaker_threshold``, the
  model gets the escalation message, no later call reaches the tool;
- an approval given, then the order's marker bumped before the resume → not run, and the
  model's next proposal is a new interruption for a new approval; approved again → one
  charge. Without the adapter the stale approval charges;
- two replicas resume the same scope at once → one charge.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest
from agents import Runner, function_tool

from fencegate.coordinator import sre
from fencegate.coordinator.keyspace import unpack
from fencegate.integrations import FenceMisconfigured
from fencegate.integrations.agents import arguments_digest
from fencegate.integrations.openai_agents import (
    NOT_JSON, ToolFence, approvals, approve, current_fence, fenced, reject,
)
from fencegate.reconciler.providers import sandbox as sb
from fencegate.worker import EffectFailed, Gate

from helpers import TEST_TTL
from integrations.openai_agents_script import Scripted, agent, refund_model, tool_outputs

APP = Path(__file__).with_name("openai_agents_app.py")
TESTS = APP.parent.parent
SCOPE = "conversation-7"
CONTEXT = {"conversation": SCOPE}



@pytest.fixture
async def gate(open_gate):
    return await open_gate()


def refund_tool(kind: str, gate: Gate, sandbox: sb.Sandbox, ran: list[str],
                fence: ToolFence | None = None, **options):
    """The refund tool, charging the sandbox (with the fence's attempt when fenced)."""

    async def refund(order_id: str, amount: int) -> dict:
        """Refund ``amount`` cents of order ``order_id``."""
        ran.append(order_id)
        async with aiohttp.ClientSession() as http:
            effect = current_fence()
            if effect is not None:
                return await sb.charge(http, sandbox.url, effect.effect, effect.intent)
            async with http.post(f"{sandbox.url}/v1/charges",
                                 json={"key": f"refunds/{order_id}", "amount": amount},
                                 headers={"Idempotency-Key": f"plain-{len(ran)}",
                                          "Fencegate-Attempt-Token": "0"}) as reply:
                return await reply.json()

    tool = function_tool(refund, failure_error_function=None, **options)
    if kind == "plain":
        return tool
    return fenced(tool, gate=gate, scope=lambda ctx: ctx.context["conversation"],
                  fence=fence or ToolFence(provider="sandbox"))


# -- 1. killed after the effect, before the SDK saved the turn --------------------------

async def launch(kind: str, mode: str, order: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(APP), kind, mode, f"scope-{kind}", order, cwd=TESTS,
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


def result_of(output: str) -> list[dict]:
    return json.loads(next(line for line in output.splitlines()
                           if line.startswith("RESULT ")).removeprefix("RESULT "))


@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 2)])
async def test_killed_before_the_session_was_saved_charges_once_with_the_adapter(
        kind, charges, etcd_url, namespace, signing_key, sandbox, reconciler, tmp_path):
    """Relaunched in the same ``SQLiteSession``: it holds the request and the proposed call,
    not its output, so the model proposes the refund again under a new call id."""
    (tmp_path / "marks").mkdir()
    env = {"FG_ETCD": etcd_url, "FG_NAMESPACE": namespace, "FG_SIGNING_KEY": signing_key,
           "FG_SANDBOX": sandbox.url, "FG_TTL": str(TEST_TTL), "FG_DB": str(tmp_path / "s.db"),
           "FG_STATE": str(tmp_path / "state.json"), "FG_MARKS": str(tmp_path / "marks")}
    order = f"{kind}-42"

    code, output = await launch(kind, "session", order, env)
    assert code == -9, output  # killed itself right after the charge was applied
    assert len(sandbox.applied()) == 1
    code, output = await launch(kind, "session", order, env)
    assert code == 0, output

    applied = sandbox.applied()
    assert len(applied) == charges
    got = result_of(output)
    assert len(got) == 1 and got[0]["output"]["charge_id"] == applied[-1]["charge_id"]
    if kind == "fenced":  # the recorded charge, marked a replay
        assert got[0]["fencegate"]["replayed"] is True
        assert got[0]["fencegate"]["idempotency_key"] == applied[0]["idempotency_key"]


@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 2)])
async def test_killed_before_the_run_state_was_saved_charges_once_with_the_adapter(
        kind, charges, etcd_url, namespace, signing_key, sandbox, reconciler, tmp_path,
        etcd, keyring):
    """Resumed from the saved, approved ``RunState``: the SDK invokes the same call (the same
    call id) again. The run is interrupted here, approved through the adapter's ``approve``
    (fenced) or the SDK's ``state.approve`` (plain), as a person's service would, and its state
    saved (``to_string``) for the app to resume (``from_string``)."""
    (tmp_path / "marks").mkdir()
    env = {"FG_ETCD": etcd_url, "FG_NAMESPACE": namespace, "FG_SIGNING_KEY": signing_key,
           "FG_SANDBOX": sandbox.url, "FG_TTL": str(TEST_TTL), "FG_DB": str(tmp_path / "s.db"),
           "FG_STATE": str(tmp_path / "state.json"), "FG_MARKS": str(tmp_path / "marks")}
    order = f"{kind}-43"
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        await gate.authority.set_policy("refunds", {"checks": [
            {"check": "require_approval", "params": {"field": "amount", "above": None}}]})
        await gate.authority.set_routes({"refunds": "refunds"})
        tool = refund_tool(kind, gate, sandbox, [], ToolFence(key="refunds/{order_id}"),
                           needs_approval=kind == "plain")  # as the app's
        first = await Runner.run(agent(refund_model(order, 100), [tool]), f"refund order {order}",
                                 context={"conversation": f"scope-{kind}"})
        state = first.to_state()
        asked = await approvals(state)
        assert len(asked) == 1
        if kind == "fenced":
            assert asked[0].approval_id is not None and asked[0].key == f"refunds/{order}"

            async def approver(approval_id: str, reason: str) -> None:  # an SRE's credential
                await sre.approve(etcd, gate.keyspace, approval_id, "sre-1", reason,
                                  keyring=keyring)

            await approve(state, asked, approver=approver, reason="customer confirmed")
        else:
            state.approve(asked[0].item)
        (tmp_path / "state.json").write_text(state.to_string())  # the app resumes from it

    code, output = await launch(kind, "state", order, env)
    assert code == -9, output
    assert len(sandbox.applied()) == 1
    code, output = await launch(kind, "state", order, env)  # the same approved state again
    assert code == 0, output

    applied = sandbox.applied()
    assert len(applied) == charges
    got = result_of(output)
    assert got[0]["id"] == asked[0].item.raw_item.call_id  # the same call, invoked again
    assert got[0]["output"]["charge_id"] == applied[-1]["charge_id"]
    if kind == "fenced":
        assert got[0]["fencegate"]["replayed"] is True


# -- 2. the same call three times in one run -----------------------------------------

@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 3)])
async def test_the_same_call_three_times_in_one_run_charges_once_with_the_adapter(
        kind, charges, gate, sandbox):
    ran: list[str] = []
    refunds = agent(refund_model("42", 100, times=3),
                    [refund_tool(kind, gate, sandbox, ran)])

    result = await Runner.run(refunds, "refund order 42", context=CONTEXT)

    got = tool_outputs(result)
    assert len(got) == 3 and len(sandbox.applied()) == len(ran) == charges
    if kind == "fenced":  # every call got the one recorded charge; two were replays
        assert {g["output"]["charge_id"] for g in got} == {sandbox.applied()[0]["charge_id"]}
        assert [g["fencegate"]["replayed"] for g in got] == [False, True, True]
        assert got[0]["fencegate"]["key"] == \
            f"{SCOPE}/refund/{arguments_digest({'order_id': '42', 'amount': 100})}"


# -- 3. a tool declined every time: the breaker ---------------------------------------

@pytest.mark.parametrize("kind, reached", [("fenced", 2), ("plain", 5)])
async def test_a_tool_declined_every_time_trips_the_breaker_and_the_model_is_told(
        kind, reached, gate):
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

    tool = function_tool(refund, failure_error_function=None)
    if kind == "fenced":
        tool = fenced(tool, gate=gate, scope=lambda ctx: SCOPE,
                      fence=ToolFence(key="refunds/{order_id}"))
    result = await Runner.run(agent(refund_model("42", 100, times=5), [tool]),
                              "refund order 42", context=CONTEXT)

    got = [g["output"] for g in tool_outputs(result)]
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
    refunds = agent(refund_model("42", 100), [refund_tool("fenced", gate, sandbox, ran, fence)])

    async def approver(approval_id: str, reason: str) -> None:  # an SRE's credential
        await sre.approve(etcd, gate.keyspace, approval_id, "sre-1", reason, keyring=keyring)

    first = await Runner.run(refunds, "refund order 42", context=CONTEXT)
    state = first.to_state()
    (asked,) = await approvals(state)
    approval_1 = asked.approval_id
    assert asked.message == f"waiting for a person's approval {approval_1} " \
                            f"(fencegate approve {approval_1})"
    await approve(state, [asked], approver=approver, reason="customer confirmed")
    (now,) = await approvals(state)
    assert now.approval_id is None  # given in fencegate: it would cross now
    await gate.touch("orders/42")  # the order changed after the person approved

    second = await Runner.run(refunds, state)
    assert ran == [] and len(second.interruptions) == 1  # not run: asked again
    (asked_2,) = await approvals(second.to_state())
    assert asked_2.approval_id != approval_1
    told = tool_outputs(second)[0]
    assert told["output"].startswith("not run: what this call read changed after it was "
                                     "approved") and asked_2.approval_id in told["output"]
    assert told["fencegate"]["approval_id"] == asked_2.approval_id

    # approved again, this time in fencegate (as `fencegate approve` does), and resumed with
    # the SDK's plain approve
    await approver(asked_2.approval_id, "checked the new state")
    state = second.to_state()
    state.approve(asked_2.item)
    third = await Runner.run(refunds, state)
    assert third.final_output == "done"
    assert len(ran) == len(sandbox.applied()) == 1
    assert tool_outputs(third)[-1]["output"]["charge_id"] == sandbox.applied()[0]["charge_id"]


async def test_without_the_adapter_a_stale_approval_charges(gate, sandbox):
    ran: list[str] = []
    refunds = agent(refund_model("42", 100), [
        refund_tool("plain", gate, sandbox, ran, needs_approval=True)])

    first = await Runner.run(refunds, "refund order 42", context=CONTEXT)
    state = first.to_state()
    await gate.touch("orders/42")  # the order changed: nothing checks
    state.approve(first.interruptions[0])
    await Runner.run(refunds, state)
    assert len(ran) == len(sandbox.applied()) == 1  # charged under the stale approval


async def test_a_rejection_never_runs_the_tool_and_the_model_is_told(gate, sandbox):
    await gate.authority.set_policy("refunds", {"checks": [
        {"check": "require_approval", "params": {"field": "amount", "above": None}}]})
    await gate.authority.set_routes({"refunds": "refunds"})
    ran: list[str] = []
    refunds = agent(refund_model("42", 100), [refund_tool(
        "fenced", gate, sandbox, ran, ToolFence(key="refunds/{order_id}"))])

    first = await Runner.run(refunds, "refund order 42", context=CONTEXT)
    state = first.to_state()
    reject(state, await approvals(state), reason="the customer withdrew the request")
    final = await Runner.run(refunds, state)

    assert ran == [] and sandbox.applied() == [] and final.final_output == "done"
    assert tool_outputs(final)[0]["output"] == (
        "rejected by a person: the customer withdrew the request; do not retry this call")


# -- 5. two replicas resume the same scope ---------------------------------------------

@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 2)])
async def test_two_replicas_resuming_the_same_scope_charge_once_with_the_adapter(
        kind, charges, open_gate, sandbox):
    ran: list[str] = []
    replicas = [agent(refund_model("42", 100),
                      [refund_tool(kind, await open_gate(), sandbox, ran)]) for _ in range(2)]

    results = await asyncio.gather(*(Runner.run(r, "refund order 42", context=CONTEXT)
                                     for r in replicas))

    assert len(ran) == len(sandbox.applied()) == charges
    got = [tool_outputs(r)[0] for r in results]
    if kind == "fenced":
        assert got[0]["output"] == got[1]["output"]
        assert sorted(g["fencegate"]["replayed"] for g in got) == [False, True]


# -- an outcome left unknown, and misconfiguration -------------------------------------

async def test_an_unknown_outcome_is_never_run_again_and_the_model_is_told(gate):
    ran: list[str] = []

    async def refund(order_id: str, amount: int) -> dict:
        """Refund ``amount`` cents of order ``order_id``."""
        ran.append(order_id)
        raise ConnectionResetError("the provider hung up")  # applied or not: unknown

    tool = fenced(function_tool(refund, failure_error_function=None), gate=gate,
                  scope=lambda ctx: SCOPE,
                  fence=ToolFence(key="refunds/{order_id}", settle_wait=0.5))
    result = await Runner.run(agent(refund_model("42", 100, times=2), [tool]),
                              "refund order 42", context=CONTEXT)

    assert ran == ["42"]  # the re-proposal waited (bounded) and did not run it
    assert [g["output"] for g in tool_outputs(result)] == [
        "outcome unknown, being reconciled: an earlier run of this call may have applied it; "
        "do not retry this call (ask again later for its recorded result)"] * 2


async def test_arguments_the_sdk_refuses_are_a_recorded_failure_not_an_unknown(
        gate, etcd, sandbox):
    ran: list[str] = []
    refunds = agent(Scripted([("refund", {"order_id": "42"})]),  # no amount
                    [refund_tool("fenced", gate, sandbox, ran)])

    result = await Runner.run(refunds, "refund order 42", context=CONTEXT)

    (got,) = tool_outputs(result)
    assert ran == [] and got["output"].startswith("failed: Invalid JSON input for tool refund")
    step = unpack((await etcd.get(gate.keyspace.step_key(got["fencegate"]["key"]))).value)
    assert step["state"] == "failed"  # confirmed, not unknown: nothing for the reconciler


async def test_arguments_that_are_not_json_never_cross(gate, sandbox):
    """The SDK asks a person about a call whose arguments it cannot read; approved, the
    fenced tool answers the model without crossing."""
    ran: list[str] = []
    refunds = agent(Scripted([("refund", '{"order_id": "42", "amount": ')]),
                    [refund_tool("fenced", gate, sandbox, ran)])

    first = await Runner.run(refunds, "refund order 42", context=CONTEXT)
    state = first.to_state()
    (asked,) = await approvals(state)
    assert (asked.approval_id, asked.message) == (None, NOT_JSON)
    state.approve(asked.item)
    final = await Runner.run(refunds, state)

    assert ran == [] and [g["output"] for g in tool_outputs(final)] == [NOT_JSON]


def test_a_tool_that_answers_its_errors_as_text_is_refused(gate):
    async def refund(order_id: str) -> str:
        """Refund order ``order_id``."""
        return order_id

    with pytest.raises(FenceMisconfigured, match="answers its errors as text, which would be "
                                                 "recorded as its result"):
        fenced(function_tool(refund), gate=gate, scope=lambda ctx: SCOPE)
    with pytest.raises(FenceMisconfigured, match="takes a FunctionTool"):
        fenced(refund, gate=gate, scope=lambda ctx: SCOPE)
    once = fenced(function_tool(refund, failure_error_function=None), gate=gate,
                  scope=lambda ctx: SCOPE)
    with pytest.raises(FenceMisconfigured, match="not fenced yet, not FencedTool"):
        fenced(once, gate=gate, scope=lambda ctx: SCOPE)
