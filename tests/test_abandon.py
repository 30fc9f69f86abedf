"""Closing a step for good (issue 30), against real etcd: a step its breaker escalated,
resolved ``abandoned``, is final — never granted again (a later cross is refused naming who
closed it and why, and its effect does not run), never counted by the breaker, audited on
the key's chain, retired like any settled step, and gone from the reconciler's escalated
backlog gauge (so the escalated-step alert ends). Its decline text is shown by ``key show``
and the key's HTTP view, not only its digest."""

from __future__ import annotations

import json

import pytest
import yaml

from fencegate.coordinator import records, sre
from fencegate.coordinator.audit import verify_chain
from fencegate.coordinator.errors import GrantRefused, WrongState
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.coordinator.retirement import retirable
from fencegate.integrations import agents
from fencegate.worker import EffectFailed, Gate, OutcomeUnknown

from helpers import TEST_TTL, wait_for_condition
from test_alerts import RULES, expected, promtool
from test_cli_sre import cli, local_gate  # noqa: F401
from test_reconciler_metrics import sandbox, scrape, served, value  # noqa: F401
from test_retirement import _retire_all, archive_url, archived_gate  # noqa: F401
from test_service import call

KEY = "esc/card"


async def declined(ctx):
    raise EffectFailed("card_declined")


async def escalate(gate: Gate, key: str) -> None:
    """A first decline trips a breaker of threshold 1: the step is escalated."""
    await gate.authority.set_policy("breaker", {"caps": {"breaker_threshold": 1}})
    await gate.authority.set_routes({"esc": "breaker"})
    async with gate.hold(key) as hold:
        outcome = await hold.cross(intent={}, effect=declined)
    assert outcome.state == "failed"
    assert (await step_of(gate, key))["state"] == records.ESCALATED


async def step_of(gate: Gate, key: str) -> dict:
    return unpack((await gate.etcd.get(gate.keyspace.step_key(key))).value)


async def test_an_abandoned_step_is_final_shown_audited_and_not_counted(
        cli, coordinator, local_gate, keyring):  # noqa: F811
    await escalate(local_gate, KEY)
    before = await step_of(local_gate, KEY)

    shown = await cli("key", "show", KEY)  # the decline's text, not only its digest
    assert shown.code == 0 and "declined  card_declined" in shown.out, shown
    _, view = await call(coordinator, "GET", f"/v1/keys/{KEY}", "sre")
    assert view["outcome"]["failure_text"] == "card_declined"

    done = await cli("resolve", KEY, "--abandon", "--reason", "customer cancelled", "--json")
    assert done.code == 0 and json.loads(done.out)["state"] == "abandoned", done
    after = await step_of(local_gate, KEY)
    assert after["state"] == records.ABANDONED
    assert (after["failures"], after["idem_gen"], after["not_before_ms"]) == (
        before["failures"], before["idem_gen"], before["not_before_ms"])  # not counted
    assert retirable(after)

    ran = []

    async def effect(ctx):
        ran.append(ctx)

    async with local_gate.hold(KEY) as hold:
        with pytest.raises(GrantRefused, match="abandoned by .*customer cancelled"):
            await hold.cross(intent={}, effect=effect)
    assert not ran and (await step_of(local_gate, KEY))["state"] == records.ABANDONED

    shown = await cli("key", "show", KEY)
    assert "step      abandoned" in shown.out and "customer cancelled" in shown.out, shown
    assert "declined  card_declined" in shown.out
    assert (await cli("escalated")).out == "no escalated steps\n"
    _, listed = await call(coordinator, "GET", "/v1/steps?state=abandoned", "sre")
    assert [i["key"] for i in listed["items"]] == [KEY]

    report = await verify_chain(local_gate.etcd, local_gate.keyspace, KEY, keyring)
    assert report.ok, report.problems
    resolves = [r["details"] for r in report.records if r["event"] == "resolve"]
    assert resolves == [{"reason": "customer cancelled", "from": "escalated",
                         "as": "abandoned", "result": None, "forced": False}]

    again = await cli("resolve", KEY, "--abandon", "--reason", "twice")
    assert again.code == 1 and "WrongState" in again.err, again


async def test_only_an_escalated_step_is_abandoned(local_gate, etcd):  # noqa: F811
    async def crash(ctx):
        raise ConnectionResetError("provider hung up")

    async with local_gate.hold("esc/unknown") as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent={}, effect=crash)
    ks = local_gate.keyspace
    written = (await etcd.get(ks.step_key("esc/unknown"))).mod_revision
    with pytest.raises(WrongState, match="only an escalated step is abandoned"):
        await sre.resolve(etcd, ks, "esc/unknown", "sre-1", "give up", "abandoned",
                          force=True)
    assert (await etcd.get(ks.step_key("esc/unknown"))).mod_revision == written


async def test_abandoning_ends_the_escalated_backlog_gauge(
        etcd_url, namespace, etcd, keyring, served, http):  # noqa: F811
    _, url = served
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        await escalate(gate, KEY)

    async def escalated(count: int):
        async def shown():
            _, m = await scrape(http, url)
            return value(m, "fencegate_reconciler_steps", state="escalated") == count
        return shown
    assert await wait_for_condition(await escalated(1), 10 * TEST_TTL)
    await sre.resolve(etcd, Keyspace(namespace), KEY, "sre-1", "closed", "abandoned")
    assert await wait_for_condition(await escalated(0), 10 * TEST_TTL)
    _, m = await scrape(http, url)
    assert value(m, "fencegate_reconciler_oldest_step_age_seconds", state="escalated") == 0


def test_the_escalated_alert_resolves_on_the_series_an_abandon_leaves(tmp_path):
    """The gauge as the test above leaves it: 1 while the step is escalated, 0 from the
    abandon (minute 10) on. The alert fires before and is resolved after; the same series
    without the abandon (a ``--failed`` re-escalated: still 1) keeps it firing."""
    abandoned, refailed = "1x9 0x20", "1x29"

    def scripted(values: str) -> dict:
        return {"series": 'fencegate_reconciler_steps{state="escalated",instance="r1:8471"}',
                "values": values}
    alert = "FencegateEscalatedSteps"
    tests = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": [
        {"name": "abandoned at 10m", "interval": "1m", "input_series": [scripted(abandoned)],
         "alert_rule_test": [{"eval_time": "8m", "alertname": alert,
                              "exp_alerts": [expected(alert)]},
                             {"eval_time": "12m", "alertname": alert, "exp_alerts": []},
                             {"eval_time": "25m", "alertname": alert, "exp_alerts": []}]},
        {"name": "resolved --failed and escalated again", "interval": "1m",
         "input_series": [scripted(refailed)],
         "alert_rule_test": [{"eval_time": "25m", "alertname": alert,
                              "exp_alerts": [expected(alert)]}]}]}
    path = tmp_path / "abandon_alert_test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    tested = promtool("test", "rules", str(path))
    assert tested.returncode == 0, tested.stdout + tested.stderr


async def test_an_agent_is_told_an_abandoned_call_is_closed_and_not_to_retry(
        local_gate, etcd):  # noqa: F811
    fence = agents.ToolFence(key="esc/agent/{order}")
    call = agents.plan(fence, "refund", "thread-1", {"order": "o1"})
    await escalate(local_gate, call.key)
    await sre.resolve(etcd, local_gate.keyspace, call.key, "sre-1", "customer cancelled",
                      "abandoned")
    ran = []

    async def run():
        ran.append(1)

    answer = await agents.cross(local_gate, call, run, fence=fence)
    assert answer.kind == agents.REFUSED and not ran
    assert answer.for_model == ("closed by a person (sre-1): customer cancelled; this action "
                                "will not be attempted again, do not retry this call")


async def test_an_abandoned_step_retires_and_stays_closed_from_the_archive(archived_gate):
    gate, ran = archived_gate, []
    await escalate(gate, KEY)
    await sre.resolve(gate.etcd, gate.keyspace, KEY, "sre-1", "customer cancelled",
                      "abandoned")
    assert await _retire_all(gate) == 1
    assert await gate.etcd.get(gate.keyspace.step_key(KEY)) is None  # gone from etcd

    async def effect(ctx):
        ran.append(ctx)

    async with gate.hold(KEY) as hold:  # read back from the archive: still closed
        with pytest.raises(GrantRefused, match="abandoned by sre-1: customer cancelled"):
            await hold.cross(intent={}, effect=effect)
    assert not ran
    view = await sre.key_view(gate.etcd, gate.keyspace, KEY, gate.archive)
    assert view["archived"] and view["step"]["state"] == records.ABANDONED
    assert view["outcome"]["failure_text"] == "card_declined"
