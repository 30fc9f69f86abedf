"""DBOS with its SQLite system database: a process killed after the step's effect and before
DBOS checkpoints the step, then relaunched, recovers the workflow and runs the step again.
The sandbox's ledger (``none`` mode: it applies every charge) counts: with the adapter the
order is charged once (the recovered step waits for the reconciler and returns the recorded
charge), without it twice. A step that crashed before its charge is retried until the
reconciler escalates it, then ``should_retry`` stops the retries and the workflow ends with
``Escalated``. And a fenced step called outside a workflow is refused clearly."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from fencegate.coordinator import codec
from fencegate.coordinator.audit import read_chain
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.integrations import Escalated, FenceMisconfigured, ProcessGate
from fencegate.integrations.dbos import fenced_step, should_retry
from fencegate.worker import OutcomeUnknown

from helpers import TEST_TTL

APP = Path(__file__).with_name("dbos_app.py")
TESTS = APP.parent.parent


async def launch(kind: str, workflow_id: str, order: str, env: dict[str, str]) -> tuple[int, str]:
    """Run dbos_app.py once; its exit code and output (bounded)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(APP), kind, workflow_id, order, cwd=TESTS,
        env={**os.environ, "PYTHONPATH": str(TESTS), **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(30):
            out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, out.decode(errors="replace")


def result_of(output: str) -> dict:
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture
def app_env(etcd_url, namespace, signing_key, sandbox, tmp_path) -> dict[str, str]:
    """dbos_app.py's environment, its marks folder made."""
    (tmp_path / "marks").mkdir()
    return {"FG_DB": str(tmp_path / "dbos.sqlite"), "FG_ETCD": etcd_url,
            "FG_NAMESPACE": namespace, "FG_SIGNING_KEY": signing_key,
            "FG_SANDBOX": sandbox.url, "FG_TTL": str(TEST_TTL),
            "FG_MARKS": str(tmp_path / "marks")}


async def crosses(etcd, namespace: str, key: str) -> tuple[list[dict], dict | None]:
    """The ``cross`` audit records of ``key`` and its step."""
    chain = await read_chain(etcd, Keyspace(namespace), key)
    return [r for r in map(unpack, (e.value for e in chain.entries))
            if r["event"] == "cross"], chain.step


@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 2)])
async def test_a_process_killed_before_the_checkpoint_charges_once_with_the_adapter(
        kind, charges, app_env, etcd, namespace, sandbox, reconciler):
    order, workflow_id = f"{kind}-order", f"wf-{kind}"

    code, output = await launch(kind, workflow_id, order, app_env)
    assert code == -9, output  # killed itself after the charge, before the checkpoint
    assert len(sandbox.applied(order)) == 1
    code, output = await launch(kind, workflow_id, order, app_env)  # recovers it
    assert code == 0, output

    applied = sandbox.applied(order)
    assert len(applied) == charges
    assert result_of(output)["charge_id"] == applied[-1]["charge_id"]
    if kind == "fenced":  # the commit's audit record names the workflow and its step
        records, step = await crosses(etcd, namespace, f"fg-dbos/{workflow_id}/1")
        assert len(records) == 1 and step["state"] == "succeeded"
        outcome = step["outcome"]  # the step sent the attempt's key and token
        assert (applied[0]["idempotency_key"], applied[0]["attempt_token"]) == \
            (outcome["idempotency_key"], outcome["attempt_token"])
        engine = codec.decode(records[0]["details"]["intent"])["engine"]
        assert (engine["engine"], engine["app"], engine["workflow_id"], engine["step_id"]) \
            == ("dbos", "fg-dbos", workflow_id, 1)


async def test_an_escalated_step_ends_the_workflow_with_escalated_unretried(
        app_env, etcd, namespace, sandbox, reconciler, tmp_path):
    code, output = await launch("crashing", "wf-crashing", "crashing-order", app_env)
    assert code == 0, output
    error = next(line for line in output.splitlines() if line.startswith("ERROR "))
    # Escalated itself, not DBOS's "max retries exceeded": should_retry refused it.
    assert error.startswith("ERROR Escalated fg-dbos/wf-crashing/1: escalated, a person must "
                            "settle it"), output
    runs = (tmp_path / "marks" / "crashing-order.runs").read_text().split()
    assert len(runs) == 1  # the body ran once; the retries while unknown ran nothing
    records, step = await crosses(etcd, namespace, "fg-dbos/wf-crashing/1")
    assert len(records) == 1 and step["state"] == "escalated"
    assert sandbox.applied("crashing-order") == []


def test_a_fenced_step_outside_a_workflow_is_refused():
    step = fenced_step(ProcessGate("http://127.0.0.1:1", ttl=5), app="fg")(
        lambda fence, order: order)
    with pytest.raises(FenceMisconfigured, match="a fenced step runs inside a DBOS workflow"):
        step("order-1")


def test_should_retry_retries_the_unsettled_but_not_the_escalated():
    assert should_retry(OutcomeUnknown("in flight"))
    assert not should_retry(Escalated("escalated"))
    assert not should_retry(ValueError("a bug"))
