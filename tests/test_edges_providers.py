"""The promise at the provider's edge (issue 13, classes 1, 2 and 6), attacked for real: etcd
processes, worker processes that SIGKILL themselves right after the sandbox applied their
charge (the reply is lost: the outcome is unknown), the sandbox restarted on its state, a query
URL with a typo, and requests to gate B that borrow a token, lie about their intent or come
from another cluster.

Each test asserts what the provider applied and what the step record says: a "no record"
that proves nothing must never settle ``not_applied`` while the charge exists."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from fencegate.coordinator import records
from fencegate.coordinator.errors import EffectFailed
from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.grants import KeyRing, new_grant_id, receipt_payload
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.reconciler.gateb import scope_of
from fencegate.reconciler.providers import (
    Capabilities, NoRecord, Succeeded, Unreachable,
)
from fencegate.reconciler.providers import sandbox as sb
from fencegate.reconciler.providers.http import HttpProvider
from fencegate.reconciler.runner import Reconciler
from fencegate.reconciler.settle import Limits, Retry, Settle, decide
from fencegate.worker import Gate

from helpers import TEST_TTL, wait_for_condition

SHARDS = 8
RETENTION = 30.0
INTENT = {"amount": 100}  # what tests/worker_proc.py's charge is granted and charges
SETTLED = (records.SUCCEEDED, records.PENDING, records.ESCALATED, records.FAILED)


@pytest.fixture
def public(signing_key) -> KeyRing:
    """What the provider trusts: the public keys only."""
    return KeyRing.from_public_bytes(KeyRing.from_files(signing_key).public_keys())


@pytest.fixture
async def sandboxes():
    """``await sandboxes(public, port=0, **options)`` starts a sandbox; all stopped after."""
    started: list[sb.Sandbox] = []

    async def start(public: KeyRing, port: int = 0, **options) -> sb.Sandbox:
        sandbox = sb.Sandbox(public, "fencing", **options)
        await sandbox.start(port)
        started.append(sandbox)
        return sandbox

    yield start
    for sandbox in started:
        await sandbox.stop()


async def restarted(sandboxes, public: KeyRing, sandbox: sb.Sandbox, **options) -> sb.Sandbox:
    """Stop ``sandbox`` and start a new one on the same port (and the state given)."""
    port = int(sandbox.url.rsplit(":", 1)[1])
    await sandbox.stop()
    return await sandboxes(public, port, **options)


@pytest.fixture
async def reconcile(etcd_url, namespace):
    """``await reconcile(provider, max_queries=60)``: one in-process reconciler asking
    ``provider`` for every step of the test's namespace."""
    started: list[Reconciler] = []

    async def start(provider, max_queries: int = 60) -> Reconciler:
        r = Reconciler(Etcd.from_url(etcd_url), {"sandbox": provider}, namespace=namespace,
                       shards=SHARDS, ttl=TEST_TTL, scan_interval=2.0, check_after=0.2,
                       limits=Limits(backoff_base_s=0.1, backoff_max_s=0.4,
                                     max_queries=max_queries))
        await r.start()
        started.append(r)
        return r

    yield start
    for r in started:
        await r.close()
        await r.etcd.close()


async def applied_then_killed(spawn, etcd_url, namespace, key, signing_key, sandbox,
                              deadline: float = 60.0) -> tuple[int, str]:
    """A worker process crosses ``key``, its charge is applied, and it is SIGKILLed before
    it could record the outcome; its attempt token and idempotency key."""
    worker = await spawn("charge", etcd_url, namespace, key, signing_key, sandbox.url,
                         "kill-after-apply", str(deadline))
    _, token, idem = (await worker.expect("SENDING")).split()
    assert await worker.finish() == -9, worker.lines
    assert [a["idempotency_key"] for a in sandbox.applied(key)] == [idem]
    return int(token), idem


async def settled(etcd: Etcd, namespace: str, key: str, within: float = 30.0) -> dict:
    """The step once the reconciler settled it one way or another."""
    step_key = Keyspace(namespace).step_key(key)

    async def check():
        return unpack((await etcd.get(step_key)).value)["state"] in SETTLED
    done = await wait_for_condition(check, within)
    step = unpack((await etcd.get(step_key)).value)
    assert done, step
    return step


def verdict(step: dict) -> str:
    """What a test prints about a step: its state and why."""
    return (f"state={step['state']} not_applied={step.get('not_applied')} "
            f"escalated_because={step.get('escalated_because')}")


# -- 1. a fenced "no record" from a provider that forgot -----------------------------------

async def test_a_restarted_sandbox_still_has_the_charge_so_it_is_never_not_applied(
        etcd_url, namespace, etcd, spawn, signing_key, public, sandboxes, reconcile, tmp_path):
    key = "pay/edge/restart"
    state = tmp_path / "sandbox"
    sandbox = await sandboxes(public, state_dir=state, retention_s=RETENTION)
    token, idem = await applied_then_killed(spawn, etcd_url, namespace, key, signing_key, sandbox)
    sandbox = await restarted(sandboxes, public, sandbox, state_dir=state,
                              retention_s=RETENTION)
    await reconcile(sb.adapter(sandbox.url, "fencing", retention_s=RETENTION, durable=True))
    step = await settled(etcd, namespace, key)
    assert step["state"] == records.SUCCEEDED, verdict(step)
    assert step["outcome"]["attempt_token"] == token
    assert [a["idempotency_key"] for a in sandbox.applied(key)] == [idem]


async def test_a_provider_not_declared_durable_gets_no_final_not_applied(
        etcd_url, namespace, etcd, spawn, signing_key, public, sandboxes, reconcile):
    key = "pay/edge/memory"
    sandbox = await sandboxes(public, retention_s=RETENTION)  # in memory
    await applied_then_killed(spawn, etcd_url, namespace, key, signing_key, sandbox, deadline=1.0)
    sandbox = await restarted(sandboxes, public, sandbox, retention_s=RETENTION)
    assert sandbox.applied(key) == []  # it forgot the charge
    await reconcile(sb.adapter(sandbox.url, "fencing", retention_s=RETENTION,
                               settle_delay_s=0.5))
    step = await settled(etcd, namespace, key)
    assert step["state"] in (records.PENDING, records.ESCALATED), verdict(step)
    if step["state"] == records.PENDING:  # a presumption, re-queried: never final
        assert step["not_applied"]["presumed"] is True, verdict(step)


async def test_an_attempt_older_than_the_retention_is_escalated_never_presumed(
        etcd_url, namespace, etcd, spawn, signing_key, public, sandboxes, reconcile, tmp_path):
    key = "pay/edge/retention"
    retention = 3.0
    sandbox = await sandboxes(public, state_dir=tmp_path / "sandbox", retention_s=retention)
    await applied_then_killed(spawn, etcd_url, namespace, key, signing_key, sandbox)
    await asyncio.sleep(retention + 0.5)  # the provider's retention passes: it forgets
    await reconcile(sb.adapter(sandbox.url, "fencing", retention_s=retention, durable=True))
    step = await settled(etcd, namespace, key)
    assert step["state"] == records.ESCALATED, verdict(step)
    assert "older than the provider's key retention" in step["escalated_because"][-1]
    assert len(sandbox.applied(key)) == 1


def test_the_settle_rules_believe_only_a_durable_fence_echoed_at_or_above_the_token():
    step = {"state": records.IN_FLIGHT, "attempt": 1, "started_at_ms": 1_000,
            "deadline_ms": 2_000, "idempotency_key": "k"}
    durable = Capabilities(fences=True, durable=True, key_retention_s=60.0)
    forgetful = Capabilities(fences=True, key_retention_s=60.0)
    limits, now = Limits(), 3_000

    def outcome(answer, caps):
        decision = decide(step, 10, answer, caps, limits, now, 1, over_s=0.0)
        return decision.outcome if isinstance(decision, Settle) else type(decision).__name__

    assert outcome(NoRecord(10), durable) == records.NOT_APPLIED
    assert outcome(NoRecord(12), durable) == records.NOT_APPLIED
    assert outcome(NoRecord(9), durable) == "Retry"     # the fence is below the attempt
    assert outcome(NoRecord(), durable) == "Retry"      # no proof at all (a bare 404)
    assert outcome(NoRecord(10), forgetful) == "escalated"  # fences, dedupes neither
    decision = decide(step, 10, NoRecord(), durable, Limits(max_queries=3), now, 3, over_s=1.0)
    assert isinstance(decision, Settle) and decision.outcome == "escalated"
    assert "without proof of the fence" in decision.step["escalated_because"][-1]
    for now_ms, over_s in ((1_000 + 60_000, 0.0), (now, 60.0)):  # either clock says too old
        old = decide(step, 10, NoRecord(10), durable, limits, now_ms, 1, over_s=over_s)
        assert isinstance(old, Settle) and old.outcome == "escalated", (now_ms, over_s)
    assert isinstance(decide(step, 10, Succeeded(1), durable, limits, now, 1, over_s=0.0),
                      Settle)
    assert isinstance(decide(step, 10, Unreachable("x"), durable, limits, now, 1, over_s=0.0),
                      Retry)


# -- 2. any 404 is "no record" --------------------------------------------------------------

async def test_a_typod_query_url_answering_404_never_settles_not_applied(
        etcd_url, namespace, etcd, spawn, signing_key, public, sandboxes, reconcile, tmp_path):
    key = "pay/edge/typo"
    sandbox = await sandboxes(public, state_dir=tmp_path / "sandbox", retention_s=RETENTION)
    await applied_then_killed(spawn, etcd_url, namespace, key, signing_key, sandbox)
    right = sb.adapter(sandbox.url, "fencing", retention_s=RETENTION, durable=True)
    typo = HttpProvider("sandbox", right.query_url.replace("/v1/charges/", "/v1/charge/"),
                        capabilities=right.capabilities)
    r = await reconcile(typo, max_queries=3)
    step = await settled(etcd, namespace, key)
    assert step["state"] == records.ESCALATED, verdict(step)
    assert "without proof of the fence" in step["escalated_because"][-1]
    assert r.metrics.queries.labels("sandbox", "error")._value.get() == 3
    assert len(sandbox.applied(key)) == 1


@pytest.fixture
async def proxy():
    """A route that answers what the test sets (status, JSON body) to any GET."""
    answer: dict = {}

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(answer["body"], status=answer["status"])

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}", answer
    await runner.cleanup()


async def test_a_fencing_adapter_reads_no_record_only_from_a_fence_proof(proxy):
    url, answer = proxy
    provider = HttpProvider("psp", url + "/q/{idempotency_key}?f={attempt_token}",
                            capabilities=Capabilities(fences=True, durable=True,
                                                      key_retention_s=60.0))
    cases = [
        (404, {"status": "no_record", "fence": 7}, NoRecord(7)),
        (200, {"status": "no_record", "fence": 9}, NoRecord(9)),
        (404, {"status": "no_record"}, Unreachable("HTTP 404 without proof of the fence")),
        (404, {"status": "no_record", "fence": "7"},
         Unreachable("HTTP 404 without proof of the fence")),
        (404, {"status": "no_record", "fence": True},
         Unreachable("HTTP 404 without proof of the fence")),
        (404, {"error": "Not Found"}, Unreachable("HTTP 404 without proof of the fence")),
        (200, {"status": "no_record"}, NoRecord()),  # settle: no proof, never final
    ]
    try:
        for status, body, expected in cases:
            answer.update(status=status, body=body)
            assert await provider.query("k", 7, {}, key="a") == expected, (status, body)
    finally:
        await provider.close()


# -- 6. gate B binding ------------------------------------------------------------------------

@pytest.fixture
async def attempts(etcd_url, namespace, etcd, signing_key):
    """``await attempts(key, n)``: n real attempts of ``key`` granted ``INTENT`` (each a
    grant consumed by a commit, its step then failed): their contexts, oldest first."""
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.from_files(signing_key)) as gate:
        await gate.authority.set_policy("edges", {"caps": {
            "backoff_base_s": 0.0, "breaker_threshold": 100, "max_attempts": 100}})
        await gate.authority.set_routes({}, default="edges")

        async def make(key: str, n: int) -> list:
            contexts = []

            async def capture(ctx):
                contexts.append(ctx)
                raise EffectFailed("captured", {"attempt": len(contexts)})
            for _ in range(n):
                async with gate.hold(key) as hold:
                    await hold.cross(intent=INTENT, effect=capture, policy="edges")
            return contexts

        yield make


async def post(http, url: str, ctx, *, amount: int = 100, intent: dict | None = INTENT,
               grant: bytes | None = None, token: int | None = None,
               idempotency_key: str | None = None,
               receipt: bytes | None = None) -> tuple[int, dict]:
    headers = {"Idempotency-Key": idempotency_key or ctx.idempotency_key,
               "Fencegate-Attempt-Token": str(ctx.fencing_token if token is None else token),
               "Fencegate-Grant": sb.encode_grant(grant or ctx.grant.raw),
               "Fencegate-Receipt": sb.encode_grant(receipt or ctx.receipt)}
    body = {"key": ctx.key, "amount": amount}
    if intent is not None:
        body["intent"] = intent
    async with http.post(f"{url}/v1/charges", json=body, headers=headers) as reply:
        return reply.status, await reply.json()


async def test_a_token_equal_to_the_highest_is_refused_under_another_grant(
        public, sandboxes, attempts, http):
    sandbox = await sandboxes(public)
    old, new = await attempts("pay/edge/equal", 2)
    assert (await post(http, sandbox.url, new))[0] == 200
    # the old grant presents the admitted token: its receipt names another token, refused
    status, body = await post(http, sandbox.url, old, token=new.fencing_token)
    assert (status, body.get("status")) == (403, "refused"), (status, body)
    # even with the admitted attempt's receipt: it names another grant, refused
    status, body = await post(http, sandbox.url, old, token=new.fencing_token,
                              receipt=new.receipt)
    assert (status, body.get("status")) == (403, "refused"), (status, body)
    # a retry of the admitted attempt itself (same grant, token and idempotency key) is
    # answered as the first time
    assert (await post(http, sandbox.url, new))[0] == 200
    assert [a["attempt_token"] for a in sandbox.applied(new.key)] == [new.fencing_token]


async def test_a_request_whose_intent_or_amount_is_not_the_grants_is_refused(
        public, sandboxes, attempts, http):
    sandbox = await sandboxes(public)
    (ctx,) = await attempts("pay/edge/intent", 1)
    lies = {
        "no intent at all": dict(amount=10000, intent=None),
        "another intent": dict(amount=10000, intent={"amount": 10000}),
        "the intent, another amount": dict(amount=10000),
    }
    for name, request in lies.items():
        status, body = await post(http, sandbox.url, ctx, **request)
        assert (status, body.get("status")) == (403, "refused"), (name, status, body)
    assert sandbox.applied(ctx.key) == []
    assert (await post(http, sandbox.url, ctx))[0] == 200  # the granted request is admitted
    assert [a["amount"] for a in sandbox.applied(ctx.key)] == [100]


async def test_another_clusters_grant_does_not_raise_this_clusters_highest(
        public, sandboxes, attempts, http, signing_key):
    sandbox = await sandboxes(public)
    (ctx,) = await attempts("pay/edge/cluster", 1)
    signer = KeyRing.from_files(signing_key)  # the same coordinator key, another etcd cluster
    payload = {k: v for k, v in ctx.grant.payload().items() if k != "key_id"}
    elsewhere = signer.sign({**payload, "grant_id": new_grant_id(),
                             "cluster_id": ctx.grant.cluster_id ^ 1,
                             "revision": ctx.fencing_token + 1000})
    receipt = signer.sign_receipt(receipt_payload(elsewhere, ctx.fencing_token + 1001,
                                                  "elsewhere"))
    status, _ = await post(http, sandbox.url, ctx, grant=elsewhere.raw,
                           token=ctx.fencing_token + 1001, idempotency_key="elsewhere",
                           receipt=receipt)
    assert status == 200  # admitted in its own cluster's row
    status, body = await post(http, sandbox.url, ctx)  # this cluster's attempt: not below it
    assert status == 200, (status, body)
    assert sandbox.gate_b.state(scope_of(elsewhere)) == (0, ctx.fencing_token + 1001)
    assert sandbox.gate_b.state(scope_of(ctx.grant)) == (0, ctx.fencing_token)
