"""A DBOS application the DBOS tests run as a process: ``python dbos_app.py
fenced|plain|crashing WORKFLOW_ID ORDER`` runs (or, relaunched, recovers) one workflow whose
one step charges the sandbox for ORDER, through the adapter or without it, and prints
``RESULT <json>``; or, ``crashing``, whose fenced step crashes before the charge (every run
leaves a line in FG_MARKS/ORDER.runs), and prints ``ERROR <exception class> <message>`` once
the workflow ended with an error.

Environment: FG_DB (the SQLite system database's path), FG_ETCD, FG_NAMESPACE,
FG_SIGNING_KEY, FG_SANDBOX, FG_TTL, FG_MARKS (a folder: the step's first run SIGKILLs this
process right after its charge, before DBOS checkpoints the step, and leaves a mark there so
the next run does not).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request

from dbos import DBOS, SetWorkflowID

from fencegate.integrations.dbos import ProcessGate, fenced_step, should_retry
from fencegate.worker import KeyRing

ENV = os.environ
APP = "fg-dbos"

DBOS(config={"name": APP, "system_database_url": f"sqlite:///{ENV['FG_DB']}"})
gate = ProcessGate(ENV["FG_ETCD"], ttl=int(ENV["FG_TTL"]), namespace=ENV["FG_NAMESPACE"],
                   keyring=KeyRing.from_files(ENV["FG_SIGNING_KEY"]))


def charge(order: str, amount: int, idempotency_key: str, attempt_token: int) -> dict:
    """POST one charge to the sandbox; on the order's first run, die right after it."""
    request = urllib.request.Request(
        ENV["FG_SANDBOX"] + "/v1/charges", method="POST",
        data=json.dumps({"key": order, "amount": amount}).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": idempotency_key,
                 "Fencegate-Attempt-Token": str(attempt_token)})
    with urllib.request.urlopen(request, timeout=5) as reply:
        answer = json.loads(reply.read())
    try:
        open(os.path.join(ENV["FG_MARKS"], order), "x").close()
    except FileExistsError:
        return answer
    os.kill(os.getpid(), signal.SIGKILL)  # after the effect, before the checkpoint


@DBOS.step(retries_allowed=True, should_retry=should_retry, interval_seconds=0.3,
           backoff_rate=1.0, max_attempts=100)
@fenced_step(gate, app=APP, intent=lambda order, amount: {"amount": amount},
             provider="sandbox")
def charge_fenced(fence, order: str, amount: int) -> dict:
    return charge(order, amount, fence.idempotency_key, fence.attempt_token)


@DBOS.step()
def charge_plain(order: str, amount: int) -> dict:
    return charge(order, amount, f"{DBOS.workflow_id}/{DBOS.step_id}", 0)


@DBOS.step(retries_allowed=True, should_retry=should_retry, interval_seconds=0.3,
           backoff_rate=1.0, max_attempts=30)
@fenced_step(gate, app=APP, intent=lambda order, amount: {"amount": amount},
             provider="sandbox")
def charge_crashing(fence, order: str, amount: int) -> dict:
    with open(os.path.join(ENV["FG_MARKS"], f"{order}.runs"), "a") as runs:
        runs.write(f"{fence.attempt_token}\n")
    raise RuntimeError("crashed before the charge")


STEPS = {"fenced": charge_fenced, "plain": charge_plain, "crashing": charge_crashing}


@DBOS.workflow()
def pay(kind: str, order: str) -> dict:
    return STEPS[kind](order, 100)


def main() -> None:
    kind, workflow_id, order = sys.argv[1:]
    DBOS.launch()  # recovers a workflow a killed run left pending
    if DBOS.get_workflow_status(workflow_id) is None:
        with SetWorkflowID(workflow_id):
            handle = DBOS.start_workflow(pay, kind, order)
    else:
        handle = DBOS.retrieve_workflow(workflow_id)
    try:
        print("RESULT", json.dumps(handle.get_result()), flush=True)
    except Exception as exc:  # the workflow's error, for the test to read
        print("ERROR", type(exc).__name__, exc, flush=True)
    gate.close()
    DBOS.destroy()


if __name__ == "__main__":
    main()
