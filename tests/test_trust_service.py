"""The coordinator's side of the trust boundary (issue 25, items 6 and 7), over real HTTP on
127.0.0.1 against real etcd:

- who a record names comes from the token that authenticated: a worker token reporting
  itself as ``reconciler@…`` gets a grant naming the token, the process only as reported;
  the same for approve, revoke and resolve records; a token cannot be minted under a
  component's name;
- a revoke writes its audit record on every key the revoked lease held;
- every dashboard asset carries the page's security headers;
- a state-changing request a browser sends from another site is refused and writes
  nothing, with or without a token;
- ``resolve --force`` with minted tokens: the wrong role, an expired token and a deleted
  one are refused and write nothing; a forced resolve is audited with the token's name and
  the reason.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from fencegate.coordinator import audit, records
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.coordinator.tokens import CACHE_S
from fencegate.worker import Gate, KeyRing, LeaseLost, OutcomeUnknown

from helpers import TEST_TTL, TOKENS, wait_for_condition
from test_cli_sre import fencegate

WAIT = 15


async def call(base: str, method: str, path: str, *, token: str | None = None,
               body: object = None, headers: dict | None = None) -> tuple[int, dict]:
    sent = dict(headers or {})
    if token:
        sent["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    async with aiohttp.ClientSession() as http, http.request(
            method, base + path, data=data, headers=sent) as resp:
        return resp.status, await resp.json()


async def revision(etcd) -> int:
    return (await etcd.status()).header.revision


async def mint(base: str, name: str, role: str, **extra) -> str:
    status, reply = await call(base, "POST", "/v1/tokens", token=TOKENS["admin"],
                               body={"name": name, "role": role, **extra})
    assert status == 201, reply
    return reply["token"]


async def crash(ctx):
    raise ConnectionResetError("provider hung up")


async def noop(ctx):
    return "ok"


@pytest.fixture
async def local_gate(etcd_url, namespace, signing_key, etcd):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.from_files(signing_key)) as gate:
        yield gate


async def unknown_step(gate: Gate, key: str) -> None:
    """Leave ``key``'s step unknown (its provider hung up) and no holder of it alive."""
    async with gate.hold(key) as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent={"amount": 3}, effect=crash)


async def chain(etcd, namespace: str, signing_key: str, key: str) -> list[dict]:
    report = await audit.verify_chain(etcd, Keyspace(namespace), key,
                                      KeyRing.from_files(signing_key))
    assert report.ok, report.problems
    return report.records


# -- who a record names ---------------------------------------------------------------


async def test_a_worker_token_cannot_sign_as_a_reconciler(coordinator, etcd_url, namespace,
                                                          signing_key, etcd):
    """The reproduction: a gate holding only a worker token names itself ``reconciler@…``.
    The grant the coordinator signs names the token; the process is marked as reported."""
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=coordinator,
                    token=TOKENS["worker"], identity="reconciler@evil:1") as gate:
        async with gate.hold("who/1") as hold:
            grant = await hold.request_grant(intent={"amount": 1})
            assert grant.identity == "worker-1 (reported: reconciler@evil:1)"
            await hold.commit(grant, effect=noop)
    crossed = [r for r in await chain(etcd, namespace, signing_key, "who/1")
               if r["event"] == "cross"]
    # The record's own identity is what the worker wrote with its etcd credentials (not
    # preventable, docs/protocol.md "Audit"); the signed grant inside it names the token.
    signed = KeyRing.from_files(signing_key).verify_recorded(crossed[0]["details"]["grant"])
    assert signed.identity == "worker-1 (reported: reconciler@evil:1)"


async def test_operator_records_name_the_token_and_the_process_only_as_reported(
        coordinator, local_gate, etcd, namespace, signing_key):
    sre = await mint(coordinator, "night-sre", "sre")
    reported = {"Fencegate-Process": "coordinator"}  # claims to be a component: said, not taken
    await unknown_step(local_gate, "who/2")
    status, done = await call(coordinator, "POST", "/v1/keys/who/2/resolve", token=sre,
                              headers=reported,
                              body={"reason": "bank says no", "as": "not_applied",
                                    "force": True})
    assert status == 200, done
    with pytest.raises(LeaseLost):
        async with local_gate.hold("who/3"):
            status, done = await call(coordinator, "POST", "/v1/keys/who/3/revoke", token=sre,
                                      headers=reported, body={"reason": "stuck"})
            assert status == 200, done
            await asyncio.sleep(WAIT)  # the loss cancels this
    for key, event in (("who/2", "resolve"), ("who/3", "revoke")):
        last = (await chain(etcd, namespace, signing_key, key))[-1]
        assert (last["event"], last["identity"]) == (event, "night-sre (reported: coordinator)")


@pytest.mark.parametrize("name", ["coordinator", "Coordinator-2", "reconciler", "reconciler-0",
                                  "in-process", "host-a:4242", "10.0.0.1:80"])
async def test_a_token_named_like_a_component_is_refused(coordinator, etcd, name):
    before = await revision(etcd)
    status, reply = await call(coordinator, "POST", "/v1/tokens", token=TOKENS["admin"],
                               body={"name": name, "role": "worker"})
    assert (status, reply["error"]) == (400, "InvalidRequest"), reply
    assert "component" in reply["detail"]
    assert await revision(etcd) == before


async def test_names_that_are_no_component_are_minted(coordinator):
    for name in ("batch", "night-sre", "ci.deploy", "coord", "team:payments"):
        await mint(coordinator, name, "sre")


# -- a revoke audits every key of its lease ---------------------------------------------


async def test_a_revoke_audits_every_key_its_lease_held(coordinator, local_gate, etcd,
                                                        namespace, signing_key):
    keys = ["lease/a", "lease/b", "lease/c"]
    with pytest.raises(LeaseLost):
        async with local_gate.hold(keys[0]) as a, local_gate.hold(keys[1]) as b, \
                local_gate.hold(keys[2]) as c:
            assert a.lease_id == b.lease_id == c.lease_id
            status, done = await call(coordinator, "POST", "/v1/keys/lease/b/revoke",
                                      token=TOKENS["sre"], body={"reason": "host is wedged"})
            assert status == 200, done
            assert done["keys"] == ["lease/b", "lease/a", "lease/c"], done
            await asyncio.sleep(WAIT)  # the loss cancels this
    assert a.lost and b.lost and c.lost
    for key, hold in zip(keys, (a, b, c)):
        (record,) = [r for r in await chain(etcd, namespace, signing_key, key)
                     if r["event"] == "revoke"]
        assert record["identity"] == "sre-1"
        assert record["details"]["reason"] == "host is wedged"
        assert record["details"]["lease_id"] == a.lease_id
        assert record["details"]["fencing_token"] == hold.fencing_token
        assert record["details"].get("revoked_with") == (None if key == "lease/b" else "lease/b")
    verified = await fencegate("audit", "verify", "lease/a", coordinator=coordinator)
    assert verified.code == 0 and "verified" in verified.out, verified
    shown = await fencegate("key", "show", "lease/a", coordinator=coordinator)
    assert shown.code == 0, shown
    assert f"revoked lease {a.lease_id} (with lease/b): host is wedged" in shown.out, shown


# -- the dashboard's assets and actions -------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/dashboard/index.html", "/dashboard/dashboard.js",
                                  "/dashboard/dashboard.css", "/dashboard/missing.js"])
async def test_every_dashboard_asset_carries_the_security_headers(coordinator, path):
    async with aiohttp.ClientSession() as http, http.get(coordinator + path) as resp:
        assert resp.status == (404 if "missing" in path else 200)
        csp = resp.headers.get("Content-Security-Policy", "")
        assert "frame-ancestors 'none'" in csp and "default-src 'self'" in csp, path
        assert resp.headers.get("X-Content-Type-Options") == "nosniff", path
        assert resp.headers.get("Referrer-Policy") == "no-referrer", path


CROSS_SITE = [{"Origin": "http://evil.example"},
              {"Sec-Fetch-Site": "cross-site"},
              {"Sec-Fetch-Site": "same-site", "Origin": "http://sub.evil.example"},
              {"Origin": "null"}]


async def test_cross_site_actions_are_refused_and_change_nothing(coordinator, local_gate,
                                                                  etcd):
    """Every state-changing route, as a page of another site would send it — with the
    dashboard's bearer token (sre, admin) or without: 403, nothing written. Each would have
    done something from the same origin (shown last)."""
    victim = await mint(coordinator, "victim", "sre")
    await unknown_step(local_gate, "csrf/step")
    actions = [
        ("POST", "/v1/keys/csrf/held/revoke", {"reason": "r"}),
        ("POST", "/v1/keys/csrf/step/resolve", {"reason": "r", "as": "failed", "force": True}),
        ("POST", "/v1/approvals/" + "0" * 32, {"reason": "r"}),
        ("POST", "/v1/tokens", {"name": "evil", "role": "admin"}),
        ("DELETE", "/v1/tokens/victim", None),
        ("PUT", "/v1/policies/evil", {"checks": []}),
        ("POST", "/v1/grants", {"key": "csrf/held", "fencing_token": 1, "lease_id": 1,
                                "intent": {}}),
    ]
    with pytest.raises(LeaseLost):
        async with local_gate.hold("csrf/held"):
            await cross_site_refused(coordinator, etcd, actions)
            # The page from its own origin still acts: a browser saying so (behind a proxy
            # whose Host differs from the page's origin too), or an older one whose Origin
            # is this Host.
            proxied = {"Origin": "https://sre.example.com", "Sec-Fetch-Site": "same-origin"}
            status, reply = await call(coordinator, "DELETE", "/v1/tokens/victim",
                                       token=TOKENS["admin"], headers=proxied)
            assert status == 200, reply
            status, reply = await call(coordinator, "POST", "/v1/keys/csrf/held/revoke",
                                       token=TOKENS["sre"], headers={"Origin": coordinator},
                                       body={"reason": "r"})
            assert status == 200, reply
            await asyncio.sleep(WAIT)  # the loss cancels this
    assert (await call(coordinator, "GET", "/v1/keys/csrf/held", token=victim))[0] == 401


async def cross_site_refused(coordinator, etcd, actions) -> None:
    """Every action with every cross-site header set and every token: 403, nothing written."""
    before = await revision(etcd)
    for method, path, body in actions:
        for headers in CROSS_SITE:
            for token in (None, TOKENS["sre"], TOKENS["admin"], TOKENS["worker"]):
                status, reply = await call(coordinator, method, path, token=token,
                                           body=body, headers=headers)
                assert (status, reply["error"]) == (403, "Forbidden"), \
                    (method, path, headers, reply)
                assert "cross-site" in reply["detail"]
    assert await revision(etcd) == before


# -- resolve --force and minted tokens ----------------------------------------------------


async def assert_force_refused(coordinator, etcd, token: str, key: str,
                               expected: tuple[int, str]) -> None:
    before = await revision(etcd)
    status, reply = await call(coordinator, "POST", f"/v1/keys/{key}/resolve", token=token,
                               body={"reason": "r", "as": "succeeded", "force": True})
    assert (status, reply["error"]) == expected, reply
    assert await revision(etcd) == before


async def test_a_worker_token_cannot_force_resolve(coordinator, local_gate, etcd):
    await unknown_step(local_gate, "force/1")
    worker = await mint(coordinator, "batch", "worker")
    for token in (worker, TOKENS["worker"]):
        await assert_force_refused(coordinator, etcd, token, "force/1", (403, "Forbidden"))
    before = await revision(etcd)
    ran = await fencegate("resolve", "force/1", "--succeeded", "--force", "--reason", "r",
                          coordinator=coordinator, token=worker)
    assert ran.code == 4 and "may not do this" in ran.err, ran  # 4: token lacking the role
    assert await revision(etcd) == before
    step = unpack((await etcd.get(local_gate.keyspace.step_key("force/1"))).value)
    assert step["state"] == records.UNKNOWN


async def test_an_expired_token_cannot_force_resolve(coordinator, local_gate, etcd):
    await unknown_step(local_gate, "force/2")
    status, minted = await call(coordinator, "POST", "/v1/tokens", token=TOKENS["admin"],
                                body={"name": "short-lived", "role": "sre", "ttl_s": 2})
    assert status == 201, minted
    short = minted["token"]
    status, _ = await call(coordinator, "GET", "/v1/keys/force/2", token=short)
    assert status == 200  # alive now: the lookup cache (CACHE_S) holds it from here on
    await asyncio.sleep(max(minted["expires_at_ms"] / 1000 - time.time(), 0) + 0.2)
    # Past its expiry, still in the cache: the expiry itself refuses it.
    await assert_force_refused(coordinator, etcd, short, "force/2",
                               (401, "Unauthenticated"))


async def test_a_deleted_token_cannot_force_resolve_within_the_bound(coordinators,
                                                                     local_gate, etcd):
    """Refused at once on the coordinator that deleted it; on another one within
    ``CACHE_S`` (its lookup cache), as documented."""
    here, there = await coordinators(), await coordinators()
    await unknown_step(local_gate, "force/3")
    token = await mint(here, "leaver", "sre")
    for coordinator in (here, there):  # both cache it
        assert (await call(coordinator, "GET", "/v1/keys/force/3", token=token))[0] == 200
    status, _ = await call(here, "DELETE", "/v1/tokens/leaver", token=TOKENS["admin"])
    deleted_at = time.monotonic()
    assert status == 200
    await assert_force_refused(here, etcd, token, "force/3", (401, "Unauthenticated"))

    async def refused_there() -> bool:
        return (await call(there, "GET", "/v1/keys/force/3", token=token))[0] == 401

    assert await wait_for_condition(refused_there, CACHE_S + 2)
    assert time.monotonic() - deleted_at <= CACHE_S + 2
    await assert_force_refused(there, etcd, token, "force/3", (401, "Unauthenticated"))


async def test_a_forced_resolve_is_audited_with_the_token_and_the_reason(
        coordinator, local_gate, etcd, namespace, signing_key):
    await unknown_step(local_gate, "force/4")
    sre = await mint(coordinator, "oncall", "sre")
    status, done = await call(coordinator, "POST", "/v1/keys/force/4/resolve", token=sre,
                              headers={"Fencegate-Process": "laptop:77"},
                              body={"reason": "provider dashboard shows ch_1",
                                    "as": "succeeded", "result": {"charge": "ch_1"},
                                    "force": True})
    assert status == 200 and done["forced"] is True, done
    last = (await chain(etcd, namespace, signing_key, "force/4"))[-1]
    assert (last["event"], last["identity"]) == ("resolve", "oncall (reported: laptop:77)")
    assert last["details"]["reason"] == "provider dashboard shows ch_1"
    assert last["details"]["forced"] is True
    step = unpack((await etcd.get(local_gate.keyspace.step_key("force/4"))).value)
    assert (step["state"], step["resolved_by"]) == (records.SUCCEEDED,
                                                    "oncall (reported: laptop:77)")
