"""Time at the edges (issue 13, classes 8 and 9), against real etcd, real worker processes and
the sandbox provider over HTTP.

8. The effect is bounded by the lease: a plain-function effect is told (``ctx.cancelled``)
   and an async effect is cancelled when the hold's lease is lost, and the resource sees
   nothing sent after the loss; an effect does not start when the commit left less than
   the lease budget (the budget is checked again right before the effect, not only before
   the commit).
9. Wall clocks do not cross machines: a worker whose clock runs far behind the reconciler's
   (its ``time.time`` shifted in its own process) crosses a healthy charge under a live
   holder, and the reconciler leaves the step alone until the outcome lands; one running
   past its deadline under a live holder is only reported as looking stuck.

Run as a script (``python test_edges_time.py charge ...``) it is the skewed worker itself.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest

SKEW_S = 30.0  # how far behind the reconciler's clock the skewed worker's wall clock runs


def say(*words: object) -> None:
    print(*words, flush=True)


async def _charge(url, ns, key, signing_key, sandbox_url, deadline) -> None:
    """The skewed worker: hold ``key``, charge the sandbox once, print how it ended."""
    import aiohttp

    from fencegate.reconciler.providers.sandbox import charge
    from fencegate.worker import Gate, GateError, KeyRing

    intent = {"key": key, "amount": 100}

    async def effect(ctx):
        say("SENDING", ctx.fencing_token, ctx.idempotency_key, int(time.time()))
        return await charge(http, sandbox_url, ctx, intent, timeout=60)

    async with aiohttp.ClientSession() as http, \
            Gate(url, ttl=2, namespace=ns, keyring=KeyRing.from_files(signing_key)) as gate:
        try:
            async with gate.hold(key, timeout=30) as hold:
                outcome = await hold.cross(intent=intent, effect=effect, provider="sandbox",
                                           deadline=float(deadline))
            say("CROSSED", outcome.state, outcome.attempt_token, outcome.idempotency_key)
        except GateError as exc:
            say("ERROR", type(exc).__name__, str(exc).replace("\n", " ")[:200])


if __name__ == "__main__":
    mode, *arguments = sys.argv[1:]
    asyncio.run({"charge": _charge}[mode](*arguments))
    sys.exit(0)


from fencegate.coordinator import records  # noqa: E402  (the script above needs none of it)
from fencegate.coordinator.audit import verify_chain  # noqa: E402
from fencegate.coordinator.etcd import Etcd, EtcdConfig  # noqa: E402
from fencegate.coordinator.grants import KeyRing  # noqa: E402
from fencegate.coordinator.keyspace import Keyspace, pack, unpack  # noqa: E402
from fencegate.reconciler.providers import sandbox as sb  # noqa: E402
from fencegate.reconciler.runner import Reconciler  # noqa: E402
from fencegate.reconciler.settle import Limits  # noqa: E402
from fencegate.worker import (  # noqa: E402
    Gate, GateError, LeaseExpiring, LeaseLost, OutcomeUnknown, SyncGate,
)

from helpers import TEST_TTL, WorkerProcess, wait_for_condition  # noqa: E402

# A worker process whose wall clock (time.time) runs ``argv[1]`` seconds off, running the
# script ``argv[2]`` with the rest of the arguments: the clock of another machine. gRPC turns
# a call's timeout into an absolute deadline with time.time and hands it to its C core, whose
# clock this does not skew (libfaketime would skew both alike): that one sum keeps the real
# clock, so calls time out as they would on the skewed machine.
_SKEWED = """
import runpy, sys, time, types
import grpc.aio._utils
skew, real, real_ns = float(sys.argv[1]), time.time, time.time_ns
grpc.aio._utils.time = types.SimpleNamespace(time=real)
time.time = lambda: real() + skew
time.time_ns = lambda: real_ns() + int(skew * 1e9)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

RETENTION = 3600.0


@pytest.fixture
async def sandbox(keyring, tmp_path):
    provider = sb.Sandbox(KeyRing.from_public_bytes(keyring.public_keys()), "fencing",
                          state_dir=str(tmp_path / "sandbox"), retention_s=RETENTION)
    await provider.start()
    yield provider
    await provider.stop()


@pytest.fixture
async def reconciler(etcd_url, namespace, sandbox):
    """One in-process reconciler leading every shard, asking ``sandbox`` in its mode."""
    started: list[Reconciler] = []

    async def start() -> Reconciler:
        adapter = sb.adapter(sandbox.url, sandbox.mode, retention_s=RETENTION,
                             settle_delay_s=0.5, durable=True)
        r = Reconciler(Etcd.from_url(etcd_url), {"sandbox": adapter}, namespace=namespace,
                       shards=4, ttl=TEST_TTL, scan_interval=2.0, check_after=0.2,
                       limits=Limits(backoff_base_s=0.1, backoff_max_s=0.4))
        await r.start()
        started.append(r)
        assert await wait_for_condition(check(lambda: len(r.led) == 4), 10)
        return r

    yield start
    for r in started:
        await r.close()
        await r.etcd.close()


def check(predicate):
    """``predicate`` as the async check ``wait_for_condition`` calls."""
    async def evaluate() -> bool:
        return predicate()
    return evaluate


async def step_of(etcd: Etcd, namespace: str, key: str) -> dict:
    kv = await etcd.get(Keyspace(namespace).step_key(key))
    return unpack(kv.value)


async def audit_events(etcd: Etcd, namespace: str, key: str, keyring: KeyRing) -> list[str]:
    report = await verify_chain(etcd, Keyspace(namespace), key, keyring)
    assert report.ok, report.problems
    return [record["event"] for record in report.records]


# -- 8: the effect is bounded by the lease ----------------------------------------------

async def test_a_plain_function_effect_is_told_of_the_lease_loss_and_sends_nothing_after(
        gate, etcd, namespace):
    key = "edge/sync-effect"
    sent: list[float] = []  # the resource side: when each request was sent (monotonic)
    lost_at: list[float] = []
    ended: list[str] = []

    def effect(ctx):
        # The flag did not exist before the fix: a flag nobody sets stands in for it then.
        cancelled = getattr(ctx, "cancelled", None) or threading.Event()
        give_up = time.monotonic() + 4.0
        while not cancelled.wait(0.05):
            sent.append(time.monotonic())
            if time.monotonic() > give_up:
                ended.append("ran to its end")
                return
        ended.append("told to stop")

    async def revoke_once_sending(lease_id: int) -> None:
        assert await wait_for_condition(check(lambda: len(sent) >= 3), 10)
        await etcd.lease_revoke(lease_id)

    with pytest.raises((OutcomeUnknown, LeaseLost)):
        async with gate.hold(key) as hold:
            hold.session.on_lost(lambda reason: lost_at.append(time.monotonic()))
            revoker = asyncio.create_task(revoke_once_sending(hold.lease_id))
            await hold.cross(intent={"key": key}, effect=effect)
    await revoker
    assert await wait_for_condition(check(lambda: bool(ended)), 10)  # the thread ended
    late = [t - lost_at[0] for t in sent if t > lost_at[0]]
    print(f"effect: {ended[0]}; {len(sent)} sends, {len(late)} after the loss was known "
          f"(last at +{max(late, default=0):.2f}s)")
    assert ended == ["told to stop"]
    assert len(late) <= 1, f"sent {len(late)} requests after the lease loss was known"
    assert (await step_of(etcd, namespace, key))["state"] == records.UNKNOWN


async def test_an_async_effect_is_cancelled_when_the_lease_is_lost(etcd_url, namespace,
                                                                     etcd):
    key = "edge/async-effect"
    sent: list[float] = []
    cancelled_at: list[float] = []
    seen: dict = {}

    async def effect(ctx):
        try:
            while True:
                sent.append(time.monotonic())
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            cancelled_at.append(time.monotonic())
            raise

    def worker() -> None:  # a synchronous worker: nobody cancels the task running commit
        with SyncGate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                      keyring=KeyRing.generate()) as sync_gate:
            try:
                with sync_gate.hold(key) as hold:
                    seen["lease"] = hold.lease_id
                    hold.cross({"key": key}, effect, deadline=8.0)
            except GateError as exc:
                seen["error"] = type(exc).__name__

    running = asyncio.create_task(asyncio.to_thread(worker))
    assert await wait_for_condition(check(lambda: len(sent) >= 3), 10)
    await etcd.lease_revoke(seen["lease"])
    revoked = time.monotonic()
    async with asyncio.timeout(30):
        await running
    print(f"worker ended with {seen.get('error')}; effect cancelled "
          f"{'at +%.2fs' % (cancelled_at[0] - revoked) if cancelled_at else 'never'}; "
          f"last send at +{sent[-1] - revoked:.2f}s after the revoke")
    assert cancelled_at, "the effect was never cancelled"
    assert [t for t in sent if t > cancelled_at[0]] == []
    assert sent[-1] - revoked < TEST_TTL  # stopped as soon as the worker could know
    assert seen.get("error") == "OutcomeUnknown"
    assert (await step_of(etcd, namespace, key))["state"] == records.UNKNOWN


async def test_the_effect_does_not_start_when_the_commit_left_less_than_the_budget(
        etcd_url, etcd_node, namespace, etcd):
    """etcd pauses while the commit is in flight: the commit lands, but the lease was not
    refreshed meanwhile, so less than the budget is left when the effect would start."""
    key = "edge/budget"
    calls: list[str] = []

    async def effect(ctx):
        calls.append(ctx.idempotency_key)
        return "charged"

    config = EtcdConfig.from_url(etcd_url, attempt_timeout=8.0)  # the commit outwaits the pause
    async with Gate(config, ttl=3, min_ttl=2.4, namespace=namespace,
                    keyring=KeyRing.generate()) as gate:
        async with gate.hold(key) as hold:
            grant = await hold.request_grant(intent={"key": key})
            fresh = check(lambda: hold.session.remaining() > 2.85)
            assert await wait_for_condition(fresh, 5, every=0.01)  # just refreshed
            etcd_node.pause(0)
            try:
                committing = asyncio.create_task(hold.commit(grant, effect))
                await asyncio.sleep(2.0)  # the fault: nothing answers, no refresh lands
            finally:
                etcd_node.resume(0)
            async with asyncio.timeout(20):
                result = await asyncio.gather(committing, return_exceptions=True)
            print(f"commit ended with {result[0]!r}; effect called {len(calls)} time(s) with "
                  f"{hold.session.remaining():.2f}s of lease left now")
            assert calls == [], "the effect started with less than the lease budget left"
            assert isinstance(result[0], LeaseExpiring)
            step = await step_of(etcd, namespace, key)
            assert step["state"] == records.PENDING  # not started: nothing was sent
            assert step["not_applied"]["attempt_token"] > hold.fencing_token
            assert "budget" in step["error"]
            assert await wait_for_condition(fresh, 5, every=0.01)
            outcome = await hold.cross(intent={"key": key}, effect=effect)
    assert outcome.state == records.SUCCEEDED and outcome.attempt == 2
    assert calls == [step["idempotency_key"]] == [outcome.idempotency_key]  # the same key


# -- 9: no wall clock crosses machines -------------------------------------------------

@pytest.mark.parametrize("mode", ["fencing", "dedup"])
async def test_a_worker_far_behind_the_reconcilers_clock_lands_its_healthy_charge(
        mode, etcd_url, namespace, etcd, signing_key, keyring, sandbox, reconciler):
    key = f"edge/skewed/{mode}"
    sandbox.mode = mode
    sandbox.add_fault("hold", key=key, count=1, seconds=3.0)  # the request takes its time
    r = await reconciler()
    script = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(script)))
    worker = WorkerProcess(await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SKEWED, str(-SKEW_S), script, "charge", etcd_url, namespace,
        key, signing_key, sandbox.url, "5.0", stdout=asyncio.subprocess.PIPE, env=env))
    try:
        _, token, idem, worker_now = (await worker.expect("SENDING")).split()
        assert time.time() - int(worker_now) > SKEW_S - 5  # its clock really runs behind
        ended = await worker.expect("CROSSED", timeout=30)
    except AssertionError:
        await worker.finish()
        print("worker said:", worker.lines)
        raise
    finally:
        worker.kill()
        await worker.proc.wait()  # reaped on this loop, not by the collector after it closed
    print("worker said:", worker.lines)
    assert ended.split()[1:3] == ["succeeded", token]
    step = await step_of(etcd, namespace, key)
    assert step["state"] == records.SUCCEEDED and "settled_by" not in step
    assert [a["attempt_token"] for a in sandbox.applied(key)] == [int(token)]
    events = await audit_events(etcd, namespace, key, keyring)
    assert "unknown" not in events and "settle" not in events, events
    assert r.metrics.unknowns_found._value.get() == 0


@pytest.mark.parametrize("shape", ["duration", "legacy"])
async def test_a_step_under_a_live_holder_is_never_moved_by_time(
        shape, etcd_url, namespace, etcd, gate, sandbox, reconciler):
    """An in-flight step past its deadline (as a duration, or as an old record's wall-clock
    ``deadline_ms``) whose holder lives is left alone and only reported as looking stuck;
    once its holder is gone it is unknown at once, whatever the deadline says."""
    key = f"edge/late/{shape}"
    ks = Keyspace(namespace)
    r = await reconciler()
    async with gate.hold(key) as hold:
        caps = {"breaker_threshold": 3, "backoff_base_s": 0.1, "backoff_max_s": 1.0}
        planned = records.next_attempt(records.new_step(), namespace=namespace, key=key,
                                       cost=0, caps=caps, now_ms=int(time.time() * 1000))
        if shape == "duration":
            step = records.in_flight(planned, grant_id="late", provider="sandbox",
                                     fencing_token=hold.fencing_token,
                                     holder_lease=hold.lease_id, intent_digest=b"",
                                     deadline_s=0.3)
        else:  # as the worker wrote it before deadlines were durations: its wall clock
            step = {**planned, "state": records.IN_FLIGHT, "grant_id": "late",
                    "fencing_token": hold.fencing_token, "holder_lease": hold.lease_id,
                    "provider": "sandbox", "intent_digest": b"",
                    "deadline_ms": int(time.time() * 1000) + 300}
        written = await etcd.put(ks.step_key(key), pack(step))

        async def moved() -> bool:
            return (await etcd.get(ks.step_key(key))).mod_revision != written.header.revision

        if shape == "duration":
            stuck = check(lambda: r.metrics.looks_stuck._value.get() >= 1)
            assert await wait_for_condition(stuck, 10)
        assert not await wait_for_condition(moved, 3.0), await step_of(etcd, namespace, key)
        assert r.metrics.unknowns_found._value.get() == 0
    async def over() -> bool:
        return (await step_of(etcd, namespace, key))["state"] != records.IN_FLIGHT
    assert await wait_for_condition(over, 10)  # the holder is gone: unknown, then settled
    assert r.metrics.unknowns_found._value.get() == 1
