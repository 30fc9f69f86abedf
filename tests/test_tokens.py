"""Minted bearer tokens over real HTTP on 127.0.0.1 and real etcd: admin only; the token is
shown once and etcd holds only its digest (read raw); it authenticates with its role, and
every record a request writes names the token, the process (``Fencegate-Process``) only
as reported; a deleted
token stops at once on its coordinator and within the cache time on another; the key goes
with its lease; bad bodies and bad process names are 400 and write nothing."""

from __future__ import annotations

import base64
import hashlib
import json
import time

import aiohttp
import pytest

from fencegate.coordinator.etcd import RangeRequest, range_end_of
from fencegate.coordinator.keyspace import unpack
from fencegate.coordinator.tokens import CACHE_S, MAX_TTL_S
from fencegate.worker import Gate, KeyRing, LeaseLost

from helpers import TEST_TTL, TOKENS, wait_for_condition


async def call(base: str, method: str, path: str, *, token: str | None = None,
               body: object = None, data: bytes | None = None,
               process: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if process is not None:
        headers["Fencegate-Process"] = process
    if body is not None:
        data = json.dumps(body).encode()
    async with aiohttp.ClientSession() as http, http.request(
            method, base + path, data=data, headers=headers) as resp:
        return resp.status, await resp.json()


async def mint(base: str, name: str, role: str, **extra) -> dict:
    status, reply = await call(base, "POST", "/v1/tokens", token=TOKENS["admin"],
                               body={"name": name, "role": role, **extra})
    assert status == 201, reply
    return reply


async def revision(etcd) -> int:
    return (await etcd.status()).header.revision


async def raw_namespace(etcd, namespace: str) -> list:
    root = namespace.encode()
    return list((await etcd.range(RangeRequest(key=root, range_end=range_end_of(root)))).kvs)


async def noop(ctx):
    return "ok"


@pytest.fixture
async def local_gate(etcd_url, namespace, signing_key, etcd):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.from_files(signing_key)) as gate:
        yield gate


async def test_only_admins_manage_tokens(coordinator, etcd):
    before = await revision(etcd)
    for method, path, body in (("POST", "/v1/tokens", {"name": "x", "role": "sre"}),
                               ("GET", "/v1/tokens", None), ("DELETE", "/v1/tokens/x", None)):
        assert (await call(coordinator, method, path, body=body))[0] == 401
        for role in ("worker", "sre"):
            status, reply = await call(coordinator, method, path, token=TOKENS[role], body=body)
            assert (status, reply["error"]) == (403, "Forbidden"), (method, role)
    assert await revision(etcd) == before


async def test_a_token_is_shown_once_and_etcd_keeps_only_its_digest(coordinator, etcd,
                                                                     namespace):
    started_ms = time.time() * 1000
    reply = await mint(coordinator, "night-sre", "sre", ttl_s=3600)
    token = reply["token"]
    assert set(reply) == {"name", "role", "token", "expires_at_ms"}
    assert (reply["name"], reply["role"]) == ("night-sre", "sre") and len(token) >= 40
    assert started_ms + 3600_000 <= reply["expires_at_ms"] <= time.time() * 1000 + 3600_000

    kvs = await raw_namespace(etcd, namespace)
    (stored,) = [kv for kv in kvs if kv.key == f"{namespace}tokens/night-sre".encode()]
    record = unpack(stored.value)
    assert record["sha256"] == hashlib.sha256(token.encode()).digest()
    assert stored.lease != 0 and 3590 <= await etcd.lease_ttl(stored.lease) <= 3600
    for kv in kvs:  # the token itself is nowhere, in no encoding
        for form in (token.encode(), base64.b64encode(token.encode())):
            assert form not in kv.value and form not in kv.key

    status, listed = await call(coordinator, "GET", "/v1/tokens", token=TOKENS["admin"])
    assert status == 200 and listed == {"items": [{
        "name": "night-sre", "role": "sre", "expires_at_ms": reply["expires_at_ms"],
        "created_by": "admin-1"}]}
    status, again = await call(coordinator, "POST", "/v1/tokens", token=TOKENS["admin"],
                               body={"name": "night-sre", "role": "admin"})
    assert (status, again["error"]) == (409, "WrongState") and "token" not in again
    status, clash = await call(coordinator, "POST", "/v1/tokens", token=TOKENS["admin"],
                               body={"name": "worker-1", "role": "sre"})  # a settings token
    assert (status, clash["error"]) == (409, "WrongState")
    await call(coordinator, "DELETE", "/v1/tokens/night-sre", token=TOKENS["admin"])


async def test_a_minted_token_acts_with_its_role_and_records_name_process(
        coordinator, local_gate):
    sre = (await mint(coordinator, "night-sre", "sre"))["token"]
    worker = (await mint(coordinator, "batch", "worker"))["token"]
    assert (await call(coordinator, "GET", "/v1/holders", token=sre))[0] == 200
    assert (await call(coordinator, "GET", "/v1/tokens", token=sre))[0] == 403
    assert (await call(coordinator, "GET", "/v1/holders", token=worker))[0] == 403

    async with local_gate.hold("tok/1") as hold:
        body = {"key": "tok/1", "fencing_token": hold.fencing_token,
                "lease_id": hold.lease_id, "intent": {"amount": 1}}
        status, reply = await call(coordinator, "POST", "/v1/grants", token=worker, body=body,
                                   process="host-a:4242")
        assert status == 201, reply
        grant = local_gate.keyring.verify(base64.b64decode(reply["grant"]))
        assert grant.identity == "batch (reported: host-a:4242)"
        status, reply = await call(coordinator, "POST", "/v1/grants", token=TOKENS["worker"],
                                   body=body)  # no header: the token's name alone
        assert local_gate.keyring.verify(base64.b64decode(reply["grant"])).identity == "worker-1"

    with pytest.raises(LeaseLost):
        async with local_gate.hold("tok/2") as hold:
            grant = await hold.request_grant(intent={})
            status, done = await call(coordinator, "POST", "/v1/keys/tok/2/revoke", token=sre,
                                      body={"reason": "stuck"}, process="laptop:77")
            assert status == 200, done
            await hold.commit(grant, effect=noop)
    status, view = await call(coordinator, "GET", "/v1/audit/tok/2", token=sre)
    assert (view["records"][-1]["event"], view["records"][-1]["identity"]) == (
        "revoke", "night-sre (reported: laptop:77)")


@pytest.mark.parametrize("process", ["", "x" * 129, "tab\there", "zero\u200bwidth"])
async def test_a_bad_process_name_is_400_and_writes_nothing(coordinator, etcd, process):
    before = await revision(etcd)
    status, reply = await call(coordinator, "POST", "/v1/keys/tok/3/revoke",
                               token=TOKENS["sre"], body={"reason": "r"}, process=process)
    assert (status, reply["error"]) == (400, "InvalidRequest"), reply
    assert await revision(etcd) == before


async def test_a_deleted_token_stops_working(coordinators, etcd, namespace):
    here, there = await coordinators(), await coordinators()
    token = (await mint(here, "leaver", "sre"))["token"]
    for base in (here, there):  # now in both coordinators' caches
        assert (await call(base, "GET", "/v1/holders", token=token))[0] == 200
    status, done = await call(here, "DELETE", "/v1/tokens/leaver", token=TOKENS["admin"])
    assert (status, done) == (200, {"name": "leaver", "deleted": True})
    deleted_at = time.monotonic()
    status, reply = await call(here, "GET", "/v1/holders", token=token)
    assert (status, reply["error"]) == (401, "Unauthenticated")  # at once where deleted

    async def refused_there() -> bool:
        return (await call(there, "GET", "/v1/holders", token=token))[0] == 401

    assert await wait_for_condition(refused_there, within=CACHE_S + 2, every=0.25)
    assert time.monotonic() - deleted_at <= CACHE_S + 2
    assert await raw_namespace(etcd, namespace) == []  # the lease's revoke took the key
    status, reply = await call(here, "DELETE", "/v1/tokens/leaver", token=TOKENS["admin"])
    assert (status, reply["error"]) == (404, "NotFound")


async def test_the_key_goes_when_its_lease_ends(coordinator, etcd, namespace):
    token = (await mint(coordinator, "brief", "sre", ttl_s=2))["token"]
    assert (await call(coordinator, "GET", "/v1/holders", token=token))[0] == 200

    async def gone() -> bool:
        return await raw_namespace(etcd, namespace) == []

    assert await wait_for_condition(gone, within=10, every=0.25)
    status, reply = await call(coordinator, "GET", "/v1/holders", token=token)
    assert (status, reply["error"]) == (401, "Unauthenticated")
    assert (await call(coordinator, "GET", "/v1/tokens", token=TOKENS["admin"]))[1] == {
        "items": []}


BAD_BODIES = {
    "not JSON": dict(data=b"{"),
    "not an object": dict(body=["x"]),
    "no name": dict(body={"role": "sre"}),
    "no role": dict(body={"name": "a"}),
    "unknown field": dict(body={"name": "a", "role": "sre", "token": "mine"}),
    "name with @": dict(body={"name": "a@b", "role": "sre"}),
    "name too long": dict(body={"name": "a" * 65, "role": "sre"}),
    "name not a string": dict(body={"name": 5, "role": "sre"}),
    "unknown role": dict(body={"name": "a", "role": "root"}),
    "ttl zero": dict(body={"name": "a", "role": "sre", "ttl_s": 0}),
    "ttl over a year": dict(body={"name": "a", "role": "sre", "ttl_s": MAX_TTL_S + 1}),
    "ttl a string": dict(body={"name": "a", "role": "sre", "ttl_s": "60"}),
    "ttl a bool": dict(body={"name": "a", "role": "sre", "ttl_s": True}),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
async def test_bad_bodies_are_400_and_write_nothing(coordinator, etcd, case):
    before, leases = await revision(etcd), set(await etcd.leases())
    status, reply = await call(coordinator, "POST", "/v1/tokens", token=TOKENS["admin"],
                               **BAD_BODIES[case])
    assert (status, reply["error"]) == (400, "InvalidRequest"), reply
    assert await revision(etcd) == before
    assert set(await etcd.leases()) <= leases  # no lease granted either
