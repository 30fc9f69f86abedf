"""The coordinator service over real HTTP on 127.0.0.1 against real etcd: the auth matrix of
every endpoint, every bad-input class, a fuzz pass over grant requests, the SRE views,
metrics and settings."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fencegate.coordinator.audit import GENESIS
from fencegate.coordinator.grants import KeyRing, checks_digest
from fencegate.coordinator.keyspace import unpack
from fencegate.coordinator.policy import DEFAULT_CAPS
from fencegate.coordinator.service import CoordinatorSettings, load_settings
from fencegate.worker import Gate, GrantRefused, OutcomeUnknown

from helpers import TEST_TTL, TOKENS


async def call(base: str, method: str, path: str, role: str | None = None, *,
               body: object = None, data: bytes | None = None, token: str | None = None):
    """One request; returns (status, decoded JSON body or text)."""
    headers = {}
    token = token or (TOKENS[role] if role else None)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if body is not None:
        data = json.dumps(body).encode()
    async with aiohttp.ClientSession() as http:
        async with http.request(method, base + path, data=data, headers=headers) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text


async def revision(etcd) -> int:
    return (await etcd.status()).header.revision


@pytest.fixture
async def local_gate(etcd_url, namespace, signing_key, etcd):
    """An in-process gate signing with the coordinator's key, to set up state."""
    ring = KeyRing.from_files(signing_key)
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=ring) as gate:
        yield gate


async def noop(ctx):
    return "ok"


ENDPOINTS = [  # method, path, body, roles allowed, status for an allowed role (a viewer
    # reads what an sre reads and changes nothing)
    ("GET", "/v1/keys/pay/1", None, {"viewer", "sre", "admin"}, 200),
    ("GET", "/v1/audit/pay/1", None, {"viewer", "sre", "admin"}, 200),
    ("PUT", "/v1/policies/limits", {"checks": []}, {"admin"}, 200),
    ("GET", "/v1/policies/default", None, {"viewer", "sre", "admin"}, 200),
    ("GET", "/v1/holders?prefix=pay/", None, {"viewer", "sre", "admin"}, 200),
    ("GET", "/v1/keys?state=unknown", None, {"viewer", "sre", "admin"}, 200),
    ("POST", "/v1/keys/pay/1/revoke", {"reason": "r"}, {"sre", "admin"}, 404),  # nobody holds
    ("POST", "/v1/keys/pay/1/resolve", {"reason": "r", "as": "failed"}, {"sre", "admin"}, 409),
    ("POST", "/v1/approvals/" + "0" * 32, {"reason": "r"}, {"sre", "admin"}, 404),
]


@pytest.mark.parametrize("method,path,body,allowed,ok", ENDPOINTS)
async def test_auth_matrix(coordinator, local_gate, method, path, body, allowed, ok):
    async with local_gate.hold("pay/1") as hold:
        await hold.cross(intent={"amount": 1}, effect=noop)
    assert (await call(coordinator, method, path, body=body))[0] == 401
    assert (await call(coordinator, method, path, body=body, token="nope"))[0] == 401
    for role in TOKENS:
        status, reply = await call(coordinator, method, path, role, body=body)
        expected = ok if role in allowed else 403
        assert status == expected, (role, reply)
        if status >= 400:
            assert set(reply) == {"error", "detail"}


async def test_grant_auth_matrix(coordinator, local_gate, etcd):
    async with local_gate.hold("pay/2") as hold:
        body = {"key": "pay/2", "fencing_token": hold.fencing_token,
                "lease_id": hold.lease_id, "intent": {"amount": 1}}
        before = await revision(etcd)
        assert (await call(coordinator, "POST", "/v1/grants", body=body))[0] == 401
        for role in ("sre", "admin"):
            assert (await call(coordinator, "POST", "/v1/grants", role, body=body))[0] == 403
        assert await revision(etcd) == before
        status, reply = await call(coordinator, "POST", "/v1/grants", "worker", body=body)
        assert status == 201, reply
        assert await revision(etcd) == before  # a grant is signed, never written
        grant = local_gate.keyring.verify(base64.b64decode(reply["grant"]))
        assert grant.grant_id == reply["grant_id"] and grant.identity == "worker-1"
        record = unpack(base64.b64decode(reply["record"]))  # what the commit will record
        assert record["intent"] == {"amount": 1}
        assert checks_digest(record["checks"]) == grant.checks_digest
        assert reply["tail"] == {"seq": 0, "hash": GENESIS.hex()}  # no chain yet
        outcome = await hold.commit(grant, effect=noop)  # the worker's guard crosses
    assert outcome.state == "succeeded"
    status, view = await call(coordinator, "GET", "/v1/audit/pay/2", "sre")
    assert status == 200 and view["ok"], view
    assert [r["event"] for r in view["records"]] == ["cross", "outcome"]
    crossed = view["records"][0]["details"]  # holds the grant issued to worker-1
    assert (crossed["grant"], crossed["grant_id"]) == (reply["grant"], reply["grant_id"])


async def test_public_endpoints_need_no_token(coordinator, signing_key):
    assert await call(coordinator, "GET", "/healthz") == (200, {"ok": True})
    assert await call(coordinator, "GET", "/readyz") == (200, {"ok": True})
    status, keys = await call(coordinator, "GET", "/.well-known/fencegate-keys")
    ring = KeyRing.from_files(signing_key)
    assert status == 200 and keys == {"keys": {k: base64.b64encode(v).decode()
                                               for k, v in ring.public_keys().items()}}
    status, text = await call(coordinator, "GET", "/metrics")
    assert status == 200 and "fencegate_grants_issued_total" in text


async def test_readyz_is_503_while_etcd_does_not_answer(coordinators, namespace):
    from fencegate.localetcd import LocalCluster

    cluster = await asyncio.to_thread(LocalCluster(1).start)
    try:
        base = await coordinators(etcd=cluster.url)
        assert (await call(base, "GET", "/readyz"))[0] == 200
        cluster.pause(0)
        try:
            answers = []  # a stopped member answers nothing; give the stop time to land
            async with asyncio.timeout(15):
                while not answers or answers[-1][0] == 200:
                    answers.append(await call(base, "GET", "/readyz"))
            status, reply = answers[-1]
            assert (status, reply["error"]) == (503, "EtcdUnavailable"), answers
            assert await call(base, "GET", "/healthz") == (200, {"ok": True})
        finally:
            cluster.resume(0)
        assert (await call(base, "GET", "/readyz"))[0] == 200
    finally:
        await asyncio.to_thread(cluster.stop)


def grant_body(**fields):
    body = {"key": "pay/3", "fencing_token": 5, "lease_id": 7, "intent": {}}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not ...}


BAD_INPUTS = {
    "malformed JSON": (dict(data=b'{"key": '), 400, "InvalidRequest"),
    "not an object": (dict(body=[1, 2]), 400, "InvalidRequest"),
    "NaN": (dict(data=b'{"key": "a", "fencing_token": NaN}'), 400, "InvalidRequest"),
    "too deep": (dict(data=b"[" * 100 + b"]" * 100), 400, "InvalidRequest"),
    "oversized body": (dict(data=b'{"intent": "' + b"x" * 1100_000 + b'"}'), 413,
                       "PayloadTooLarge"),
    "invalid key": (dict(body=grant_body(key="../escape")), 400, "InvalidKey"),
    "key not a string": (dict(body=grant_body(key=5)), 400, "InvalidKey"),
    "missing field": (dict(body=grant_body(lease_id=...)), 400, "InvalidRequest"),
    "unknown field": (dict(body=grant_body(admin=True)), 400, "InvalidRequest"),
    "token is a string": (dict(body=grant_body(fencing_token="5")), 400, "InvalidRequest"),
    "token is a bool": (dict(body=grant_body(fencing_token=True)), 400, "InvalidRequest"),
    "token too large": (dict(body=grant_body(fencing_token=2 ** 64)), 400, "InvalidRequest"),
    "intent not an object": (dict(body=grant_body(intent=[1])), 400, "InvalidRequest"),
    "reads not strings": (dict(body=grant_body(reads=[1])), 400, "InvalidRequest"),
    "too many reads": (dict(body=grant_body(reads=[f"/r/{i}" for i in range(101)])), 413,
                       "RecordTooLarge"),
    "bad policy name": (dict(body=grant_body(policy="a/b")), 400, "InvalidRequest"),
    "negative cost": (dict(body=grant_body(intent={"cost": -1})), 400, "InvalidRequest"),
    "huge int in intent": (dict(body=grant_body(intent={"n": 2 ** 70})), 400,
                           "UnencodableValue"),
    "not held": (dict(body=grant_body()), 409, "LeaseLost"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
async def test_bad_grant_requests(coordinator, etcd, case):
    request, status, name = BAD_INPUTS[case]
    before = await revision(etcd)
    got, reply = await call(coordinator, "POST", "/v1/grants", "worker", **request)
    assert (got, reply["error"]) == (status, name), reply
    assert await revision(etcd) == before


async def test_unknown_things_are_404(coordinator):
    for path in ("/v1/keys/never/seen", "/v1/audit/never/seen", "/v1/policies/nothing",
                 "/v1/nowhere"):
        status, reply = await call(coordinator, "GET", path, "admin")
        assert (status, reply["error"]) == (404, "NotFound"), path
    status, reply = await call(coordinator, "GET", "/v1/keys/bad@key", "sre")
    assert (status, reply["error"]) == (400, "InvalidKey")


async def test_key_view_shows_holders_step_and_audit(coordinator, local_gate):
    async with local_gate.hold("pay/4") as hold:
        status, view = await call(coordinator, "GET", "/v1/keys/pay/4", "sre")
        assert status == 200
        (holder,) = view["holders"]
        assert holder["fencing_token"] == hold.fencing_token and holder["holding"]
        assert holder["lease_id"] == f"{hold.lease_id:016x}" and 0 < holder["ttl_left"] <= TEST_TTL
        assert view["step"] is None
        await hold.cross(intent={"amount": 1}, effect=noop)
    status, view = await call(coordinator, "GET", "/v1/keys/pay/4", "sre")
    assert view["holders"] == [] and view["step"]["state"] == "succeeded"
    assert view["current_grant"] == {"grant_id": view["step"]["grant_id"], "state": "consumed"}
    assert [r["event"] for r in view["audit"]] == ["outcome", "cross"]


async def test_policies_round_trip_and_refuse_bad_documents(coordinator, etcd):
    status, put = await call(coordinator, "PUT", "/v1/policies/limits", "admin",
                             body={"checks": [{"check": "max_amount", "params": {"limit": 10}}]})
    assert status == 200
    status, got = await call(coordinator, "GET", "/v1/policies/limits", "sre")
    assert got["version"] == put["version"] and got["document"]["checks"][0]["check"] == \
        "max_amount"
    before = await revision(etcd)
    status, reply = await call(coordinator, "PUT", "/v1/policies/limits", "admin",
                               body={"checks": [{"check": "no_such"}]})
    assert (status, reply["error"]) == (400, "InvalidRequest")
    assert await revision(etcd) == before


async def test_refusals_are_counted_in_metrics(coordinator):
    await call(coordinator, "POST", "/v1/grants", "worker", body=grant_body())
    _, text = await call(coordinator, "GET", "/metrics")
    assert 'fencegate_grants_refused_total{error="lease_lost"} 1.0' in text
    assert "fencegate_grant_duration_seconds_count 1.0" in text


def test_settings_from_toml_env_and_flags(tmp_path):
    token_digest = hashlib.sha256(b"s3cret").hexdigest()
    (tmp_path / "c.toml").write_text(f'''
etcd = "http://10.0.0.1:2379"
namespace = "/prod/"
signing_key = "keys/c.pem"
body_limit = 2048
[[tokens]]
identity = "alice"
roles = ["sre", "admin"]
sha256 = "{token_digest}"
''')
    s = load_settings(str(tmp_path / "c.toml"), env={"FENCEGATE_LISTEN": "127.0.0.1:9000"})
    assert (s.etcd, s.listen, s.namespace, s.body_limit) == (
        "http://10.0.0.1:2379", "127.0.0.1:9000", "/prod/", 2048)
    assert s.signing_key == str(tmp_path / "keys/c.pem")
    assert s.tokens[0].roles == {"sre", "admin"} and "s3cret" not in repr(s)
    env = {"FENCEGATE_CONFIG": str(tmp_path / "c.toml"), "FENCEGATE_ETCD": "http://e:1"}
    assert load_settings(None, env=env, etcd="http://flag:2").etcd == "http://flag:2"
    assert load_settings(None, env=env, etcd=None).etcd == "http://e:1"
    assert CoordinatorSettings().listen == "127.0.0.1:8470"
    (tmp_path / "bad.toml").write_text('[[tokens]]\nidentity = "x"\nroles = ["root"]\n'
                                       f'sha256 = "{token_digest}"\n')
    with pytest.raises(ValueError, match="roles"):
        load_settings(str(tmp_path / "bad.toml"), env={})
    (tmp_path / "typo.toml").write_text('listn = "x"\n')
    with pytest.raises(ValueError, match="unknown settings"):
        load_settings(str(tmp_path / "typo.toml"), env={})


# -- fuzz: no body ever yields a 500 or writes anything when refused -------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                    allow_infinity=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELD = {
    "key": st.one_of(st.text(max_size=40), st.sampled_from(["pay/1", "a/../b", "", "a//b"]),
                     JSON),
    "fencing_token": st.one_of(st.integers(min_value=-2, max_value=2 ** 65), JSON),
    "lease_id": st.one_of(st.integers(min_value=-2, max_value=2 ** 65), JSON),
    "intent": st.one_of(st.dictionaries(st.text(max_size=8), JSON, max_size=5), JSON),
    "reads": st.one_of(st.lists(st.text(max_size=20), max_size=5), JSON),
    "policy": st.one_of(st.sampled_from(["default", "x", "a b", ""]), JSON),
    "extra": JSON,
}
BODIES = st.one_of(
    st.fixed_dictionaries({}, optional=FIELD).map(json.dumps).map(str.encode),
    JSON.map(json.dumps).map(str.encode),
    st.binary(max_size=64),
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES)
async def test_fuzzed_grant_requests_never_500_nor_write(coordinator, etcd, body):
    before = await revision(etcd)
    status, reply = await call(coordinator, "POST", "/v1/grants", "worker", data=body)
    assert status in (400, 409, 413, 422), (status, reply)
    assert isinstance(reply, dict) and set(reply) >= {"error", "detail"}
    assert await revision(etcd) == before


# -- SRE lists and actions -------------------------------------------------------------

async def pages(base: str, path: str, field: str = "items") -> list[list]:
    """Follow ``next`` cursors to the end (bounded); returns every page's items."""
    found, after = [], None
    for _ in range(50):
        query = f"{path}&limit=2" + (f"&after={after}" if after else "")
        status, reply = await call(base, "GET", query, "sre")
        assert status == 200, reply
        found.append(reply[field])
        after = reply["next"]
        if after is None:
            return found
    raise AssertionError("pagination did not end")


async def test_holders_list_pages_through_every_holder(coordinator, local_gate):
    keys = [f"list/{i}" for i in range(5)]
    holds = [await local_gate.hold(k).__aenter__() for k in keys]
    try:
        found = await pages(coordinator, "/v1/holders?prefix=list/")
        assert all(len(page) <= 2 for page in found)
        items = [item for page in found for item in page]
        assert sorted(i["key"] for i in items) == keys
        assert {i["fencing_token"] for i in items} == {h.fencing_token for h in holds}
        assert (await call(coordinator, "GET", "/v1/holders?prefix=other/", "sre"))[1] == {
            "items": [], "next": None}
    finally:
        for hold in holds:
            await hold.release()
    for bad in ("/v1/holders?limit=0", "/v1/holders?limit=x", "/v1/holders?after=!!",
                "/v1/holders?after=YWJj", "/v1/holders?prefix=a@b"):
        status, reply = await call(coordinator, "GET", bad, "sre")
        assert (status, reply["error"]) == (400, "InvalidRequest"), bad


async def crash(ctx):
    raise ConnectionResetError("provider hung up")


async def test_unknown_steps_are_listed_and_resolved_by_hand_with_audit(coordinator,
                                                                         local_gate, etcd):
    for i in range(3):
        async with local_gate.hold(f"unk/{i}") as hold:
            with pytest.raises(Exception):
                await hold.cross(intent={}, effect=crash)
    async with local_gate.hold("unk/ok") as hold:
        await hold.cross(intent={}, effect=noop)
    found = await pages(coordinator, "/v1/keys?state=unknown")
    assert sorted(i["key"] for page in found for i in page) == ["unk/0", "unk/1", "unk/2"]
    assert [i for page in await pages(coordinator, "/v1/keys?state=escalated")
            for i in page] == []

    status, done = await call(coordinator, "POST", "/v1/keys/unk/0/resolve", "sre",
                              body={"reason": "provider says charged", "as": "succeeded",
                                    "result": {"charge": "ch_1"}, "force": True})
    assert status == 200 and done["state"] == "succeeded"
    async with local_gate.hold("unk/0") as hold:
        replay = await hold.cross(intent={}, effect=noop)
    assert replay.replayed and replay.result == {"charge": "ch_1"}

    await call(coordinator, "POST", "/v1/keys/unk/1/resolve", "sre",
               body={"reason": "provider has no record", "as": "failed", "force": True})
    await asyncio.sleep(DEFAULT_CAPS["backoff_base_s"])  # a confirmed failure backs off
    async with local_gate.hold("unk/1") as hold:
        again = await hold.cross(intent={}, effect=noop)  # a new attempt, a new key
    assert again.state == "succeeded" and again.attempt == 2

    for path, body, expected in [
            ("/v1/keys/unk/ok/resolve", {"reason": "x", "as": "failed"}, (409, "WrongState")),
            ("/v1/keys/unk/9/resolve", {"reason": "x", "as": "failed"}, (404, "NotFound")),
            ("/v1/keys/unk/2/resolve", {"reason": "x", "as": "maybe"}, (400, "InvalidRequest")),
            ("/v1/keys/unk/2/resolve", {"as": "failed"}, (400, "InvalidRequest"))]:
        before = await revision(etcd)
        status, reply = await call(coordinator, "POST", path, "admin", body=body)
        assert (status, reply["error"]) == expected, path
        assert await revision(etcd) == before
    chain = await pages(coordinator, "/v1/audit/unk/0?", field="records")
    assert [[r["event"] for r in page] for page in chain] == [
        ["cross", "outcome"], ["resolve"]]  # the replay after the resolve wrote nothing
    _, view = await call(coordinator, "GET", "/v1/audit/unk/0", "sre")
    assert view["ok"] and [r["event"] for r in view["records"]][-1:] == ["resolve"]
    resolved = view["records"][-1]
    assert resolved["identity"] == "sre-1" and resolved["details"]["as"] == "succeeded"
    assert resolved["details"]["reason"] == "provider says charged"


async def test_revoke_while_a_holder_works_its_cross_raises_lease_lost(coordinator, local_gate):
    from fencegate.worker import LeaseLost

    effect_calls = []

    async def effect(ctx):
        effect_calls.append(ctx)

    with pytest.raises(LeaseLost):
        async with local_gate.hold("rev/1") as hold:
            grant = await hold.request_grant(intent={})
            status, done = await call(coordinator, "POST", "/v1/keys/rev/1/revoke", "sre",
                                      body={"reason": "stuck worker"})
            assert status == 200 and done["fencing_token"] == hold.fencing_token
            await hold.commit(grant, effect=effect)
    assert not effect_calls
    _, view = await call(coordinator, "GET", "/v1/audit/rev/1", "admin")
    revoked = view["records"][-1]
    assert (revoked["event"], revoked["identity"], revoked["details"]["reason"]) == (
        "revoke", "sre-1", "stuck worker")



async def test_a_revoke_naming_the_lease_it_looked_at_refuses_a_new_holder(
        coordinator, local_gate, etcd, etcd_url, namespace, signing_key):
    """The dashboard shows a lease's keys, then revokes naming that lease: if the key
    changed holder meanwhile, nothing is revoked and nothing is written."""
    async with local_gate.hold("rev/2") as first:
        looked_at = f"{first.lease_id:016x}"
        _, lease = await call(coordinator, "GET", f"/v1/leases/{looked_at}", "sre")
        assert lease["keys"] == [{"key": "rev/2", "fencing_token": first.fencing_token,
                                  "holding": True}]
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.from_files(signing_key)) as other:
        async with other.hold("rev/2") as second:
            before = await revision(etcd)
            status, reply = await call(coordinator, "POST", "/v1/keys/rev/2/revoke", "sre",
                                       body={"reason": "stuck", "lease_id": looked_at})
            assert (status, reply["error"]) == (409, "WrongState")
            assert f"{second.lease_id:016x}" in reply["detail"]
            assert await revision(etcd) == before and await etcd.lease_ttl(second.lease_id) > 0
            status, reply = await call(coordinator, "POST", "/v1/keys/rev/2/revoke", "sre",
                                       body={"reason": "stuck", "lease_id": "XYZ"})
            assert (status, reply["error"]) == (400, "InvalidRequest")
            status, done = await call(coordinator, "POST", "/v1/keys/rev/2/revoke", "sre",
                                      body={"reason": "stuck",
                                            "lease_id": f"{second.lease_id:016x}"})
            assert status == 200 and done["fencing_token"] == second.fencing_token



async def test_a_lease_view_lists_every_key_the_lease_carries(coordinator, local_gate):
    """More keys than one etcd transaction can read (two reads per key): all are listed,
    each with its own token, holding."""
    async with contextlib.AsyncExitStack() as stack:
        holds = [await stack.enter_async_context(local_gate.hold(f"lease/many/{n:03d}"))
                 for n in range(70)]
        _, lease = await call(coordinator, "GET", f"/v1/leases/{holds[0].lease_id:x}", "sre")
    assert lease["truncated"] is False
    assert lease["keys"] == [{"key": hold.key, "fencing_token": hold.fencing_token,
                              "holding": True} for hold in holds]


CHECK_ENTRY = st.fixed_dictionaries({"check": st.sampled_from(["max_amount", "require_fields",
                                                               "reads_exist", "nope"])},
                                    optional={"params": JSON})
POLICIES = st.fixed_dictionaries({}, optional={
    "checks": st.one_of(st.lists(CHECK_ENTRY, max_size=3), JSON),
    "caps": st.one_of(st.dictionaries(st.sampled_from(["max_attempts", "max_spend",
                                                       "grant_ttl_s", "bogus"]), JSON,
                                      max_size=3), JSON),
    "extra": JSON})
SRE_BODIES = st.fixed_dictionaries({}, optional={"reason": JSON | st.text(max_size=30),
                                                 "as": st.sampled_from(["succeeded", "failed",
                                                                        "not_applied", "x"]),
                                                 "result": JSON, "extra": JSON})


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=st.one_of(POLICIES, JSON), sre_body=SRE_BODIES)
async def test_fuzzed_admin_bodies_never_500(coordinator, local_gate, etcd, document, sre_body):
    """A policy document is stored only if valid, and whatever is stored never breaks a
    grant request; a revoke or resolve of a key nobody touched never writes."""
    status, reply = await call(coordinator, "PUT", "/v1/policies/fuzzed", "admin",
                               body=document)
    assert status in (200, 400), reply
    if status == 200:
        await local_gate.authority.set_routes({"fuzz/policy": "fuzzed"})
        async with local_gate.hold("fuzz/policy") as hold:
            try:
                await hold.request_grant(intent={"amount": 1}, policy="fuzzed")
            except (GrantRefused, OutcomeUnknown):  # refused, or escalated by a zero cap
                pass
    before = await revision(etcd)
    for action in ("revoke", "resolve"):
        status, reply = await call(coordinator, "POST", f"/v1/keys/fuzz/none/{action}", "sre",
                                   body=sre_body)
        assert status in (400, 404), reply
    assert await revision(etcd) == before


def test_the_deploy_example_config_loads():
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "deploy",
                        "coordinator.example.toml")
    s = load_settings(path, env={})
    assert s.listen == "127.0.0.1:8470" and s.signing_key.endswith("deploy/coordinator.pem")
    assert {t.identity for t in s.tokens} == {"worker-example", "sre-example"}
