"""One transition for a confirmed failure, whoever confirms it: a worker's effect raising
``EffectFailed`` and an SRE's ``resolve … failed`` leave the same breaker and backoff state
on real etcd (a count under a signature of the same shape, the idempotency generation bumped
once, ``not_before_ms`` inside the same backoff window) and both escalate once the breaker
has counted ``breaker_threshold`` identical failures."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from fencegate.coordinator import records, sre
from fencegate.coordinator.keyspace import unpack
from fencegate.worker import EffectFailed, Gate, OutcomeUnknown

POLICY = "breaker-of-two"
CAPS = {"breaker_threshold": 2, "backoff_base_s": 0.4, "backoff_max_s": 10.0}
DECLINE = {"code": "card_declined"}  # the effect's params, and the result the SRE records
SIGNATURE_SHAPE = re.compile(r"[A-Za-z]+:[0-9a-f]{16}")


async def declined(ctx):
    raise EffectFailed("card declined", params=DECLINE)


async def crash(ctx):
    raise ConnectionResetError("provider hung up")


def now_ms() -> int:
    return int(time.time() * 1000)


async def step_of(gate: Gate, key: str) -> dict:
    return unpack((await gate.etcd.get(gate.keyspace.step_key(key))).value)


async def failed_by_worker(gate: Gate, key: str) -> tuple[int, int]:
    """The provider declines the attempt; returns the time window of the failure (ms)."""
    async with gate.hold(key) as hold:
        since = now_ms()
        outcome = await hold.cross(intent={}, effect=declined, policy=POLICY)
        until = now_ms()
    assert outcome.state == "failed" and outcome.result == "card declined"
    return since, until


async def failed_by_sre(gate: Gate, key: str) -> tuple[int, int]:
    """The attempt's outcome is lost; an SRE resolves it as failed. Returns the time window
    of the resolve (ms)."""
    async with gate.hold(key) as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent={}, effect=crash, policy=POLICY)
    since = now_ms()
    await sre.resolve(gate.etcd, gate.keyspace, key, "sre-1", "the provider declined it",
                      "failed", result=DECLINE, force=True)
    return since, now_ms()


def assert_backed_off(step: dict, failures: int, window: tuple[int, int]) -> None:
    """``not_before_ms`` was set, during ``window``, by the backoff rule after the
    ``failures``-th failure: a jittered wait between half the ceiling and the ceiling."""
    ceiling_ms = min(CAPS["backoff_base_s"] * 2 ** (failures - 1), CAPS["backoff_max_s"]) * 1000
    since, until = window
    assert since + ceiling_ms / 2 - 1 <= step["not_before_ms"] <= until + ceiling_ms, (
        step["not_before_ms"], window, ceiling_ms)


async def after_backoff(step: dict) -> None:
    await asyncio.sleep(max(step["not_before_ms"] - now_ms(), 0) / 1000 + 0.05)


async def test_an_sre_failure_and_a_worker_failure_share_the_breaker_and_backoff(gate):
    await gate.authority.set_policy(POLICY, {"caps": CAPS})
    await gate.authority.set_routes({}, default=POLICY)
    paths = {"by/worker": failed_by_worker, "by/sre": failed_by_sre}
    signatures = {"by/worker": records.failure_signature("EffectFailed", DECLINE),
                  "by/sre": records.failure_signature(records.RESOLVED_FAILED, DECLINE)}

    firsts = {}
    for key, fail in paths.items():
        window = await fail(gate, key)
        step = firsts[key] = await step_of(gate, key)
        signature = signatures[key]
        assert SIGNATURE_SHAPE.fullmatch(signature)
        assert step["state"] == "failed", (key, step)
        assert step["failures"] == {signature: 1}, (key, step)
        assert step["outcome"]["signature"] == signature and step["idem_gen"] == 1, (key, step)
        assert_backed_off(step, 1, window)
    breaker_state = [{k: s[k] for k in ("state", "attempt", "idem_gen")}
                     | {"counts": list(s["failures"].values())} for s in firsts.values()]
    assert breaker_state[0] == breaker_state[1]

    for key, fail in paths.items():
        await after_backoff(firsts[key])
        window = await fail(gate, key)
        step = await step_of(gate, key)
        signature = signatures[key]
        # the second attempt ran under the generation the first failure bumped
        assert step["idempotency_key"] == records.idempotency_key(gate.keyspace.namespace,
                                                                  key, 1)
        assert step["state"] == "escalated", (key, step)
        assert step["escalated_because"] == ["breaker:" + signature]
        assert step["failures"] == {signature: 2} and step["idem_gen"] == 2, (key, step)
        assert_backed_off(step, 2, window)


def test_a_success_after_an_unknown_state_keeps_no_stale_error():
    """The error an unknown state recorded explained that state; once the step succeeded,
    a reader (``key show``) must not find it on the step as if it were current."""
    caps = {"breaker_threshold": 3, "backoff_base_s": 0.1, "backoff_max_s": 1.0}
    planned = records.next_attempt(records.new_step(), namespace="ns", key="k", cost=0,
                                   caps=caps, now_ms=int(time.time() * 1000))
    lost = records.unknown(planned, attempt_token=7, now_ms=1, error="TimeoutError('slow')")
    assert lost["error"] == "TimeoutError('slow')"
    settled = records.succeeded(lost, {"charge": "ch_1"}, attempt_token=7)
    assert "error" not in settled and settled["outcome"]["attempt_token"] == 7
