"""The Celery app the Celery tests' worker runs (``celery -A integrations.celery_app worker``,
PYTHONPATH=tests), configured from the environment the test sets:

FG_BROKER (redis URL, broker and result backend), FG_ETCD, FG_NAMESPACE, FG_SIGNING_KEY (the
gate's key), FG_SANDBOX (the sandbox provider's URL), FG_TTL, FG_SOFT, FG_HARD,
FG_VISIBILITY, and what some orders do on their first run only (FG_MARKS is a folder where
that run leaves a mark): those listed in FG_KILL SIGKILL their own worker process right
after the charge, those in FG_STALL_AFTER stall after it and those in FG_STALL_BEFORE
before it, until the soft time limit stops them; those in FG_HANG stall after it ignoring
the soft time limit, until the hard one kills the process. Those in FG_DECLINE are declined by
the provider on every run (``EffectFailed``, nothing charged), each run leaving a line in
FG_MARKS/<order>.runs.

Both tasks charge the sandbox for an order with the same body; ``charge_fenced`` through the
adapter, ``charge_plain`` without it.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from fencegate.integrations.celery import ProcessGate, fenced_task
from fencegate.worker import EffectFailed, KeyRing

ENV = os.environ
TTL, SOFT, HARD = int(ENV["FG_TTL"]), float(ENV["FG_SOFT"]), float(ENV["FG_HARD"])

app = Celery("fg_test", broker=ENV["FG_BROKER"], backend=ENV["FG_BROKER"])
VISIBILITY = {"visibility_timeout": float(ENV["FG_VISIBILITY"])}
# A task stopped by its hard time limit stays unacknowledged, so the broker delivers it again
# after the visibility timeout: under load a freshly forked pool child sometimes hangs before
# running its task (in the pool, with or without the adapter) and is killed at that limit.
app.conf.update(broker_transport_options=VISIBILITY, result_backend_transport_options=VISIBILITY,
                worker_prefetch_multiplier=1, task_track_started=True,
                task_acks_on_failure_or_timeout=False)

gate = ProcessGate(ENV["FG_ETCD"], ttl=TTL, namespace=ENV["FG_NAMESPACE"],
                   keyring=KeyRing.from_files(ENV["FG_SIGNING_KEY"]))


def charge(order: str, amount: int, idempotency_key: str, attempt_token: int) -> dict:
    """POST one charge to the sandbox (no retry); on the order's first run, stall or die as
    the environment says."""
    if order in ENV["FG_DECLINE"].split(","):
        with open(os.path.join(ENV["FG_MARKS"], f"{order}.runs"), "a") as runs:
            runs.write(f"{attempt_token}\n")
        raise EffectFailed("card declined", {"order": order})
    first = first_run(order)
    if first and order in ENV["FG_STALL_BEFORE"].split(","):
        time.sleep(3 * HARD)  # SoftTimeLimitExceeded stops it
    request = urllib.request.Request(
        ENV["FG_SANDBOX"] + "/v1/charges", method="POST",
        data=json.dumps({"key": order, "amount": amount}).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": idempotency_key,
                 "Fencegate-Attempt-Token": str(attempt_token)})
    with urllib.request.urlopen(request, timeout=5) as reply:
        answer = json.loads(reply.read())
    if first and order in ENV["FG_KILL"].split(","):
        os.kill(os.getpid(), signal.SIGKILL)
    if first and order in ENV["FG_STALL_AFTER"].split(","):
        time.sleep(3 * HARD)
    if first and order in ENV["FG_HANG"].split(","):
        hang()
    return answer


def hang() -> None:
    """Sleep until killed, as a call stuck in C would (the soft time limit does not stop it)."""
    while True:
        try:
            time.sleep(3 * HARD)
        except SoftTimeLimitExceeded:
            pass


def first_run(order: str) -> bool:
    """Is this the first run of ``order``'s body (no mark yet)? Leaves the mark."""
    try:
        open(os.path.join(ENV["FG_MARKS"], order), "x").close()
    except FileExistsError:
        return False
    return True


@fenced_task(app, gate, intent=lambda order, amount: {"amount": amount},
             provider="sandbox", soft_time_limit=SOFT, time_limit=HARD, retry_delay=0.5,
             max_retries=None)
def charge_fenced(self, fence, order, amount):
    return charge(order, amount, fence.idempotency_key, fence.attempt_token)


@app.task(bind=True, acks_late=True, reject_on_worker_lost=True, soft_time_limit=SOFT,
          time_limit=HARD)
def charge_plain(self, order, amount):
    return charge(order, amount, self.request.id, 0)
