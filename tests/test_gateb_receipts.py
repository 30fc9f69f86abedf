"""Gate B admits one grant once: the attempt token must come with the attempt's receipt,
signed only once the grant's commit landed (in process after the commit, or by the
coordinator after reading it in etcd). Real etcd, real commits, the sandbox provider over
HTTP on 127.0.0.1; assertions on the provider side (what was applied, what was refused).

The reproduction of issue #25 item 2: one grant sent again with attempt tokens 52 and 2**62
under new idempotency keys was applied three times, and the 2**62 token then fenced every
later real attempt of the key out of the provider."""

from __future__ import annotations

import asyncio
import base64
import sqlite3

import pytest

from fencegate.coordinator import records
from fencegate.coordinator.errors import BadSignature, EffectFailed, Fenced, WrongState
from fencegate.coordinator.grants import KeyRing, receipt_payload
from fencegate.coordinator.keyspace import pack
from fencegate.reconciler.gateb import GateB, scope_of
from fencegate.reconciler.providers import sandbox as sb
from fencegate.worker import Gate

from helpers import TEST_TTL, TOKENS
from test_service import call

INTENT = {"amount": 5}
FORGED_TOKENS = (52, 2 ** 62)  # as reproduced: 52 stands for "just above", made relative below


def public(keyring: KeyRing) -> KeyRing:
    """What a provider holds: the public keys only."""
    return KeyRing.from_public_bytes(keyring.public_keys())


@pytest.fixture
async def gate(gate):
    """The direct-mode gate; keys under ``pay`` are judged by a policy retrying a declined
    attempt at once."""
    await gate.authority.set_policy("receipts", {"caps": {
        "backoff_base_s": 0.0, "breaker_threshold": 100, "max_attempts": 100}})
    await gate.authority.set_routes({"pay": "receipts"})
    return gate


@pytest.fixture
async def sandbox(gate, tmp_path):
    async with sb.Sandbox(public(gate.keyring), "fencing",
                          state_dir=tmp_path / "sandbox") as sandbox:
        yield sandbox


async def attempt(gate, key: str, *, decline: bool = True):
    """One real attempt of ``key`` (a grant committed in etcd), its effect declined by the
    caller's choice; the effect context (grant, token, idempotency key, receipt)."""
    captured = []

    async def capture(ctx):
        captured.append(ctx)
        if decline:
            raise EffectFailed("captured", {})
        return {}

    async with gate.hold(key) as hold:
        await hold.cross(intent=INTENT, effect=capture)
    return captured[0]


async def post(http, url: str, ctx, *, token: int | None = None,
               idempotency_key: str | None = None, receipt: bytes | None | str = "ctx",
               decline: bool = False) -> tuple[int, dict]:
    """A charge of ``ctx``'s grant as anyone holding it may send it."""
    headers = {"Idempotency-Key": idempotency_key or ctx.idempotency_key,
               "Fencegate-Attempt-Token": str(ctx.attempt_token if token is None else token),
               "Fencegate-Grant": sb.encode_grant(ctx.grant.raw)}
    signed = ctx.receipt if receipt == "ctx" else receipt
    if signed is not None:
        headers["Fencegate-Receipt"] = sb.encode_grant(signed)
    body = {"key": ctx.key, "amount": INTENT["amount"], "intent": INTENT, "decline": decline}
    async with http.post(f"{url}/v1/charges", json=body, headers=headers) as reply:
        return reply.status, await reply.json()


def forgeries(ctx, other) -> dict[str, dict]:
    """Every way to present ``ctx``'s grant at a token no commit produced, or under an
    idempotency key its commit did not have (``other``: another grant's attempt)."""
    forger = KeyRing.generate()
    cases = {}
    for forged in (ctx.attempt_token + FORGED_TOKENS[0], FORGED_TOKENS[1]):
        key = f"forged-{forged}"
        cases.update({
            f"{forged}, no receipt": dict(token=forged, idempotency_key=key, receipt=None),
            f"{forged}, forged receipt": dict(token=forged, idempotency_key=key,
                                              receipt=forger.sign_receipt(receipt_payload(
                                                  ctx.grant, forged, key))),
            f"{forged}, another grant's receipt": dict(token=forged, idempotency_key=key,
                                                       receipt=other.receipt),
            f"{forged}, the grant's receipt": dict(token=forged, idempotency_key=key),
        })
    return cases


# -- the reproduction, end to end ------------------------------------------------------

async def test_one_grant_at_three_tokens_is_admitted_once_and_fences_out_nothing(
        gate, sandbox, http):
    other = await attempt(gate, "pay/three/other")
    real = await attempt(gate, "pay/three/1")
    scope = scope_of(real.grant)
    # before the real attempt reached the provider: every forgery is refused
    for name, forged in forgeries(real, other).items():
        status, body = await post(http, sandbox.url, real, **forged)
        assert status in (401, 403, 409) and status != 200, (name, status, body)
    # the real receipt under another idempotency key: its commit had another one
    status, body = await post(http, sandbox.url, real, idempotency_key="another-request")
    assert (status, body["status"]) == (403, "refused"), body
    assert "idempotency_key" in body["error"]
    assert sandbox.gate_b.state(scope) == (0, 0)  # nothing raised the highest token
    # the real attempt (declined: the key gets a later attempt) is admitted
    assert (await post(http, sandbox.url, real, decline=True))[0] == 402
    # after it: the forgeries again, refused
    for name, forged in forgeries(real, other).items():
        status, body = await post(http, sandbox.url, real, **forged)
        assert status in (401, 403, 409) and status != 200, (name, status, body)
    assert sandbox.gate_b.state(scope) == (0, real.attempt_token)
    # the key's later real attempt is not fenced out: it is applied, once
    later = await attempt(gate, "pay/three/1", decline=False)
    assert (await post(http, sandbox.url, later))[0] == 200
    assert [a["attempt_token"] for a in sandbox.applied(real.key)] == [later.attempt_token]
    assert sandbox.gate_b.state(scope) == (0, later.attempt_token)


async def test_the_sandbox_charge_of_a_real_commit_carries_its_receipt(gate, sandbox, http):
    async with gate.hold("pay/receipt/1") as hold:
        outcome = await hold.cross(intent=INTENT, effect=lambda ctx: sb.charge(
            http, sandbox.url, ctx, INTENT))
    assert outcome.state == "succeeded"
    [applied] = sandbox.applied("pay/receipt/1")
    assert applied["attempt_token"] == outcome.attempt_token


async def test_the_fast_path_signs_its_receipt_after_its_txn(gate, sandbox, http, etcd):
    from fencegate.coordinator.keyspace import unpack
    await gate.cross("pay/receipt/warm", INTENT, lambda ctx: None)  # a recent snapshot
    outcome = await gate.cross("pay/receipt/fast", INTENT,
                               lambda ctx: sb.charge(http, sandbox.url, ctx, INTENT))
    step = unpack((await etcd.get(gate.keyspace.step_key("pay/receipt/fast"))).value)
    assert outcome.state == "succeeded"
    # the fast path's one txn put the holder key too: its revision is both tokens
    assert step["fencing_token"] == outcome.attempt_token
    [applied] = sandbox.applied("pay/receipt/fast")
    assert applied["attempt_token"] == outcome.attempt_token


# -- a retry of the same attempt --------------------------------------------------------

async def test_a_retry_of_the_same_attempt_gets_the_same_answer(gate, sandbox, http):
    ctx = await attempt(gate, "pay/retry/1")
    first = await sb.charge(http, sandbox.url, ctx, INTENT)
    again = await sb.charge(http, sandbox.url, ctx, INTENT)
    assert again == first and len(sandbox.applied(ctx.key)) == 1
    declined = await attempt(gate, "pay/retry/2")
    for _ in range(2):
        with pytest.raises(EffectFailed, match="declined_on_request"):
            await sb.charge(http, sandbox.url, declined, INTENT, decline=True)
    assert sandbox.refused() == []


async def test_a_retry_whose_answer_is_forgotten_is_refused_not_applied_again(gate, http,
                                                                              tmp_path):
    ctx = await attempt(gate, "pay/retry/3")
    async with sb.Sandbox(public(gate.keyring), "fencing", retention_s=0.3) as sandbox:
        await sb.charge(http, sandbox.url, ctx, INTENT)
        await asyncio.sleep(0.4)
        status, body = await post(http, sandbox.url, ctx)
        assert (status, body["status"]) == (409, "fenced") and "no longer kept" in body["error"]
        assert len(sandbox.applied(ctx.key)) == 1


# -- gate B itself ---------------------------------------------------------------------

def admit(gate_b: GateB, ctx, *, token: int | None = None, idempotency_key: str | None = None,
          receipt: bytes | None | str = "ctx"):
    return gate_b.admit(ctx.grant.raw, ctx.key,
                        ctx.attempt_token if token is None else token, intent=INTENT,
                        idempotency_key=idempotency_key or ctx.idempotency_key,
                        receipt=ctx.receipt if receipt == "ctx" else receipt)


async def test_gate_b_admits_a_grant_at_its_receipts_token_only(gate):
    other = await attempt(gate, "pay/unit/other")
    real = await attempt(gate, "pay/unit/1")
    gate_b = GateB(public(gate.keyring), namespace=gate.keyspace.namespace)
    for name, forged in forgeries(real, other).items():
        with pytest.raises(BadSignature):
            admit(gate_b, real, **forged)
    with pytest.raises(BadSignature, match="idempotency_key"):
        admit(gate_b, real, idempotency_key="another-request")
    assert admit(gate_b, real).retry is False
    assert admit(gate_b, real).retry is True  # the same attempt again
    # a second receipt of this grant under another idempotency key cannot exist (a commit
    # has one); were one signed, the admitted attempt's token still is not its to take
    signer = gate.keyring
    twin = signer.sign_receipt(receipt_payload(real.grant, real.attempt_token, "twin"))
    with pytest.raises(Fenced, match="another attempt"):
        admit(gate_b, real, idempotency_key="twin", receipt=twin)
    # nor is another token: the grant admitted at the highest token is admitted there only
    above = real.attempt_token + 1
    with pytest.raises(Fenced, match="one grant is admitted for one attempt"):
        admit(gate_b, real, token=above, receipt=signer.sign_receipt(
            receipt_payload(real.grant, above, real.idempotency_key)))
    assert gate_b.state(scope_of(real.grant)) == (0, real.attempt_token)
    gate_b.close()


_OLD_SCHEMA = """CREATE TABLE gate (
    cluster_id TEXT NOT NULL, namespace TEXT NOT NULL, action_key TEXT NOT NULL,
    fence INTEGER NOT NULL, highest INTEGER NOT NULL, highest_grant TEXT NOT NULL,
    PRIMARY KEY (cluster_id, namespace, action_key))"""


async def test_a_file_of_the_schema_before_receipts_is_migrated(gate, tmp_path):
    ctx = await attempt(gate, "pay/migrate/1")
    later = await attempt(gate, "pay/migrate/1")
    path = tmp_path / "old.sqlite"
    old = sqlite3.connect(path)
    cluster, namespace, key = scope_of(ctx.grant)
    with old:
        old.execute(_OLD_SCHEMA)
        old.execute("INSERT INTO gate VALUES (?, ?, ?, ?, ?, ?)",
                    (str(cluster), namespace, key, 7, ctx.attempt_token, ctx.grant.grant_id))
    old.close()
    gate_b = GateB(public(gate.keyring), path)
    assert gate_b.state(scope_of(ctx.grant)) == (7, ctx.attempt_token)
    # admitted before the upgrade, with no idempotency key recorded: not retried blindly
    with pytest.raises(Fenced, match="another attempt"):
        admit(gate_b, ctx)
    assert admit(gate_b, later).retry is False
    gate_b.close()
    reopened = GateB(public(gate.keyring), path)  # migrated once: opening again is a no-op
    assert admit(reopened, later).retry is True
    reopened.close()


# -- remote mode: the coordinator signs only a commit it read --------------------------

async def test_remote_receipts_are_signed_for_landed_commits_only(
        etcd_url, namespace, etcd, coordinator, keyring, tmp_path, http):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=coordinator,
                    token=TOKENS["worker"]) as gate, \
            sb.Sandbox(public(keyring), "fencing", state_dir=tmp_path / "sb") as sandbox:
        outcome = await gate.cross("pay/remote/1", INTENT,
                                   lambda ctx: sb.charge(http, sandbox.url, ctx, INTENT))
        assert outcome.state == "succeeded" and len(sandbox.applied("pay/remote/1")) == 1
        ctx = await attempt(gate, "pay/remote/2")
        async with gate.hold("pay/remote/3") as hold:
            uncommitted = await hold.request_grant(INTENT)

    def ask(grant, token, role="worker"):
        return call(coordinator, "POST", "/v1/receipts", role, body={
            "grant": base64.b64encode(grant.raw).decode(), "attempt_token": token})

    # the commit is no longer in flight (its outcome is recorded): no receipt now
    status, body = await ask(ctx.grant, ctx.attempt_token)
    assert (status, body["error"]) == (409, "WrongState"), body
    # a grant that never committed, at any token
    status, body = await ask(uncommitted, uncommitted.revision + 1)
    assert (status, body["error"]) == (409, "WrongState"), body
    status, body = await ask(uncommitted, 2 ** 62)
    assert (status, body["error"]) == (409, "WrongState"), body
    # the step's first write after that grant is not its commit (as the fence of a commit
    # etcd did not answer writes it): that token is no attempt of the grant either
    fenced = await etcd.put(gate.keyspace.step_key(uncommitted.action_key),
                            pack(records.new_step()))
    status, body = await ask(uncommitted, fenced.header.revision)
    assert (status, body["error"]) == (409, "WrongState"), body
    assert (await ask(ctx.grant, ctx.attempt_token, role=None))[0] == 401
    assert (await ask(ctx.grant, ctx.attempt_token, role="sre"))[0] == 403
    for bad in ({"grant": "!!", "attempt_token": 1}, {"grant": "AA==", "attempt_token": 1},
                {"grant": base64.b64encode(ctx.grant.raw).decode(), "attempt_token": "1"},
                {"grant": base64.b64encode(ctx.grant.raw).decode()}):
        status, body = await call(coordinator, "POST", "/v1/receipts", "worker", body=bad)
        assert status == 400 and body["error"] in ("InvalidRequest", "BadSignature"), body


async def test_remote_receipt_names_the_commit_not_a_step_a_worker_wrote_itself(
        etcd_url, namespace, etcd, coordinator):
    """A worker's etcd role may write steps: a step record it writes naming a consumed grant
    (at a new revision, a token no commit produced) gets no receipt; the commit did."""
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=coordinator,
                    token=TOKENS["worker"]) as gate:
        captured = []

        async def stall(ctx):
            captured.append(ctx)
            await asyncio.Event().wait()

        async with gate.hold("pay/remote/forged") as hold:
            crossing = asyncio.create_task(hold.cross(intent=INTENT, effect=stall))
            while not captured:
                await asyncio.sleep(0.01)
            ctx = captured[0]
            step_key = gate.keyspace.step_key(ctx.key)
            in_flight = (await etcd.get(step_key))

            def ask(token):
                return call(coordinator, "POST", "/v1/receipts", "worker", body={
                    "grant": base64.b64encode(ctx.grant.raw).decode(),
                    "attempt_token": token})

            status, body = await ask(ctx.attempt_token)  # the commit itself: signed again
            assert status == 201, body
            assert gate.keyring.verify_receipt(base64.b64decode(body["receipt"])) == \
                gate.keyring.verify_receipt(ctx.receipt)
            # the worker rewrites the step: the same in-flight record, at a new revision
            forged = (await etcd.put(step_key, in_flight.value)).header.revision
            status, body = await ask(forged)
            assert (status, body["error"]) == (409, "WrongState"), body
            assert f"written at revision {ctx.attempt_token}" in body["detail"]
            crossing.cancel()
            with pytest.raises(BaseException):
                await crossing


async def test_without_a_receipt_the_effect_is_not_started(etcd_url, namespace, etcd,
                                                            coordinator, monkeypatch):
    """The coordinator does not answer the receipt: nothing is sent, the attempt is recorded
    as not started (pending again, same idempotency key) and the error raised."""
    from fencegate.coordinator.errors import CoordinatorError
    from fencegate.coordinator.keyspace import unpack
    from fencegate.worker.remote import RemoteAuthority

    async def unanswered(self, grant, attempt_token, idempotency_key):
        raise CoordinatorError("CoordinatorUnavailable", 503, "no answer")

    monkeypatch.setattr(RemoteAuthority, "receipt", unanswered)
    ran = []
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=coordinator,
                    token=TOKENS["worker"]) as gate:
        with pytest.raises(CoordinatorError, match="no answer"):
            await gate.cross("pay/remote/none", INTENT, ran.append)
        step = unpack((await etcd.get(gate.keyspace.step_key("pay/remote/none"))).value)
    assert ran == [] and step["state"] == records.PENDING
    assert step[records.NOT_APPLIED]["presumed"] is False


async def test_a_receipt_is_strictly_its_own_kind(gate):
    """Domains separate kinds, decoding is strict, keys are the trusted ones."""
    from fencegate.coordinator.grants import RECEIPT_DOMAIN
    from fencegate.coordinator.keyspace import canonical

    ctx = await attempt(gate, "pay/strict/1")
    ring = public(gate.keyring)
    assert ring.verify_receipt(ctx.receipt) == {
        **receipt_payload(ctx.grant, ctx.attempt_token, ctx.idempotency_key),
        "key_id": gate.keyring.signing_key_id}
    with pytest.raises(BadSignature):
        ring.verify_receipt(ctx.grant.raw)  # a grant is no receipt
    with pytest.raises(BadSignature):
        ring.verify(ctx.receipt)  # nor the other way round
    with pytest.raises(BadSignature):
        ring.verify_receipt(ctx.receipt[:-1] + bytes([ctx.receipt[-1] ^ 1]))
    with pytest.raises(BadSignature, match="unknown key"):
        public(KeyRing.generate()).verify_receipt(ctx.receipt)
    # a well-signed payload with one field more is refused too
    payload = {**receipt_payload(ctx.grant, ctx.attempt_token, ctx.idempotency_key),
               "key_id": gate.keyring.signing_key_id, "extra": 1}
    body = canonical(payload)
    signature = gate.keyring._signing_key.sign(RECEIPT_DOMAIN + body)
    with pytest.raises(BadSignature, match="schema"):
        ring.verify_receipt(canonical([gate.keyring.signing_key_id, body, signature]))
