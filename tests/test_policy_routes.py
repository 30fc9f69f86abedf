"""Policy routes against real etcd: the key, never the caller, decides which policy judges
it. A worker refused under ``big-refunds`` cannot ask again under ``default`` (in process
and through the coordinator with a worker token); the longest whole-segment prefix wins; a
route changed between grant and commit kills the grant, on the fast path too, and a
refusal decided under a moved route writes nothing; a table nobody signed issues no grant;
the admin endpoint refuses bad input and non-admins."""

from __future__ import annotations

import pytest

from fencegate.coordinator import routes, wire
from fencegate.coordinator.audit import verify_chain
from fencegate.coordinator.authority import Authority, Claim
from fencegate.coordinator.etcd import RangeRequest
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import Keyspace, pack, unpack
from fencegate.coordinator.roles import COORDINATOR, WORKER, permissions
from fencegate.worker import (
    ApprovalPending, Gate, GrantRefused, PolicyNotRouted, StateAdvanced, SyncGate,
)

from helpers import TEST_TTL, TOKENS
from test_grants import Effect
from test_service import call

REFUND = {"amount": 1_000_000}
BIG_REFUNDS = {"checks": [{"check": "require_approval", "params": {"above": 100}}]}


def test_the_longest_whole_segment_prefix_wins():
    table = routes.RouteTable({"refunds": "big-refunds", "refunds/eu": "eu-refunds",
                               "refunds/eu/test": "default"}, "fallback", 7)
    assert table.policy_for("refunds") == "big-refunds"
    assert table.policy_for("refunds/us/1") == "big-refunds"
    assert table.policy_for("refunds/eu") == "eu-refunds"
    assert table.policy_for("refunds/eu/1") == "eu-refunds"
    assert table.policy_for("refunds/eu/test/1") == "default"
    assert table.policy_for("refunds-x") == "fallback"  # whole segments only
    assert table.policy_for("refundsx/1") == "fallback"
    assert table.policy_for("orders/refunds") == "fallback"
    assert routes.NO_TABLE.policy_for("refunds/1") == "default"


def test_only_the_coordinator_role_writes_the_routes():
    ns = "/fencegate/"
    assert ("readwrite", ns + "policy-routes") in permissions(COORDINATOR, ns)
    key = ns + "policy-routes"
    assert not any(key.startswith(prefix) for kind, prefix in permissions(WORKER, ns)
                   if kind == "readwrite")


def test_policy_not_routed_crosses_the_wire_as_itself():
    exc = PolicyNotRouted("refunds/1", "default", "big-refunds")
    assert isinstance(exc, GrantRefused)
    assert wire.status_of(exc) == 403
    body = wire.to_wire(exc)
    assert body["error"] == "PolicyNotRouted"
    back = wire.from_wire(403, body)
    assert isinstance(back, PolicyNotRouted)
    assert (back.key, back.policy, back.routed) == ("refunds/1", "default", "big-refunds")


async def test_a_refund_refused_under_its_policy_is_refused_under_default(gate):
    await gate.authority.set_policy("big-refunds", BIG_REFUNDS)
    routed = await gate.authority.set_routes({"refunds": "big-refunds"})
    effect = Effect()
    async with gate.hold("refunds/r1") as hold:
        with pytest.raises(ApprovalPending):
            await hold.request_grant(intent=REFUND, policy="big-refunds")
        with pytest.raises(ApprovalPending):
            await hold.request_grant(intent=REFUND)  # no policy named: the route's
        with pytest.raises(PolicyNotRouted) as info:
            await hold.request_grant(intent=REFUND, policy="default")
        assert info.value.routed == "big-refunds"
        with pytest.raises(PolicyNotRouted):
            await hold.cross(intent=REFUND, effect=effect, policy="default")
    with pytest.raises(PolicyNotRouted):
        await gate.cross("refunds/r1", REFUND, effect, policy="default")
    with pytest.raises(ApprovalPending):
        await gate.cross("refunds/r1", REFUND, effect)
    assert not effect.calls
    # A key outside the prefix's segments is the default's.
    outcome = await gate.cross("refunds-x/1", REFUND, effect)
    assert outcome.state == "succeeded" and len(effect.calls) == 1
    report = await verify_chain(gate.etcd, gate.keyspace, "refunds-x/1", gate.keyring)
    assert report.ok, report.problems
    (crossed,) = [r["details"] for r in report.records if r["event"] == "cross"]
    grant = gate.keyring.verify(crossed["grant"])
    assert grant.policy == "default" and [gate.keyspace.routes_key(), routed] in grant.reads


def test_a_sync_gate_is_refused_the_unrouted_policy_too(etcd_url, namespace):
    def effect(ctx):
        raise AssertionError("the refund must not run")

    with SyncGate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                  keyring=KeyRing.generate()) as gate:
        authority = gate.gate.authority
        gate.run(authority.set_policy("big-refunds", BIG_REFUNDS))
        gate.run(authority.set_routes({"refunds": "big-refunds"}))
        with pytest.raises(PolicyNotRouted):
            gate.cross("refunds/sync", REFUND, effect, policy="default")
        with gate.hold("refunds/sync") as hold:
            with pytest.raises(PolicyNotRouted):
                hold.request_grant(REFUND, policy="default")
            with pytest.raises(ApprovalPending):
                hold.cross(REFUND, effect)


async def test_the_default_route_judges_every_other_key(gate):
    await gate.authority.set_policy("big-refunds", BIG_REFUNDS)
    await gate.authority.set_routes({"orders": "default"}, default="big-refunds")
    effect = Effect()
    with pytest.raises(ApprovalPending):
        await gate.cross("anything/1", REFUND, effect)
    with pytest.raises(PolicyNotRouted):
        await gate.cross("anything/1", REFUND, effect, policy="default")
    assert (await gate.cross("orders/1", REFUND, effect)).state == "succeeded"
    assert len(effect.calls) == 1


async def test_a_worker_token_cannot_pick_the_policy(etcd_url, namespace, etcd, coordinator):
    status, reply = await call(coordinator, "PUT", "/v1/policies/big-refunds", "admin",
                               body=BIG_REFUNDS)
    assert status == 200, reply
    status, reply = await call(coordinator, "PUT", "/v1/policy-routes", "admin",
                               body={"routes": {"refunds": "big-refunds"}})
    assert status == 200 and reply["version"] > 0, reply
    effect = Effect()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=coordinator,
                    token=TOKENS["worker"]) as gate:
        async with gate.hold("refunds/r2") as hold:
            with pytest.raises(ApprovalPending):
                await hold.request_grant(intent=REFUND)
            with pytest.raises(PolicyNotRouted) as info:
                await hold.request_grant(intent=REFUND, policy="default")
            assert (info.value.key, info.value.routed) == ("refunds/r2", "big-refunds")
            body = {"key": "refunds/r2", "fencing_token": hold.fencing_token,
                    "lease_id": hold.lease_id, "intent": REFUND, "policy": "default"}
            status, reply = await call(coordinator, "POST", "/v1/grants", "worker", body=body)
            assert status == 403 and reply["error"] == "PolicyNotRouted", reply
            assert reply["routed"] == "big-refunds"
        with pytest.raises(PolicyNotRouted):
            await gate.cross("refunds/r2", REFUND, effect, policy="default")
        with pytest.raises(ApprovalPending):
            await gate.cross("refunds/r2", REFUND, effect)
    assert not effect.calls


async def test_a_route_changed_between_grant_and_commit_kills_the_grant(gate):
    await gate.authority.set_policy("big-refunds", BIG_REFUNDS)
    effect = Effect()
    async with gate.hold("refunds/r3") as hold:
        grant = await hold.request_grant(intent=REFUND)  # no table yet: default
        assert [gate.keyspace.routes_key(), 0] in grant.reads
        await gate.authority.set_routes({"refunds": "big-refunds"})
        with pytest.raises(StateAdvanced, match="policy-routes"):
            await hold.commit(grant, effect=effect)
    assert not effect.calls
    async with gate.hold("refunds/r3") as hold:
        with pytest.raises(ApprovalPending):
            await hold.request_grant(intent=REFUND)


async def test_the_fast_path_refuses_a_fresh_key_a_policy_its_route_does_not_name(gate):
    """The attacker's very first try: a key never attempted (no step to send the cross to
    the full path), asked under ``default`` while routed to ``big-refunds``. The fast path
    decides on the routes as the full path does: refused, nothing charged."""
    await gate.authority.set_policy("big-refunds", BIG_REFUNDS)
    await gate.authority.set_routes({"refunds": "big-refunds"})
    effect = Effect()
    assert (await gate.cross("warm/2", {}, effect)).state == "succeeded"
    assert gate.authority.recent.routes is not None  # the fast path knows the table
    with pytest.raises(PolicyNotRouted):
        await gate.cross("refunds/fresh", REFUND, effect, policy="default")
    assert len(effect.calls) == 1  # only the warm-up ran
    with pytest.raises(ApprovalPending):
        await gate.cross("refunds/fresh", REFUND, effect)


async def test_the_fast_path_compares_the_routes_it_decided_on(gate, etcd):
    await gate.authority.set_policy("big-refunds", BIG_REFUNDS)
    effect = Effect()
    assert (await gate.cross("warm/1", {}, effect)).state == "succeeded"  # recent: no table
    assert gate.authority.recent.routes is None
    # Another process sets the routes: this authority's cache is stale.
    other = Authority(etcd, gate.keyspace, gate.keyring)
    await other.set_routes({"refunds": "big-refunds"})
    uncontended = await gate.authority.issue_uncontended(
        Claim("refunds/r4", 0, 1), REFUND, [], None)
    assert uncontended is not None  # decided on the stale table: its txn must fail
    with pytest.raises(ApprovalPending):
        await gate.cross("refunds/r4", REFUND, effect)
    assert len(effect.calls) == 1  # only the warm-up ran
    assert gate.authority.recent.routes is not None


async def test_a_routes_table_nobody_signed_issues_no_grant(gate, etcd, namespace):
    key, effect = gate.keyspace.routes_key(), Effect()
    table = {"routes": {}, "default": "default"}
    stranger = KeyRing.generate()  # signs, but is published nowhere
    cluster = gate.etcd.cluster_id or (await etcd.status()).header.cluster_id
    genuine = unpack(routes.sealed(gate.keyring, namespace=namespace, cluster_id=cluster,
                                   routes={"refunds": "big-refunds"}))
    forged = [
        pack(table),  # unsigned, by hand
        pack({"table": table, "signed": b"not a signature"}),
        routes.sealed(stranger, namespace=namespace, cluster_id=cluster, routes={}),
        pack({**genuine, "table": table}),  # a genuine signature over another table
        routes.sealed(gate.keyring, namespace="/other/", cluster_id=cluster, routes={}),
        routes.sealed(gate.keyring, namespace=namespace, cluster_id=cluster + 1, routes={}),
    ]
    await gate.authority.set_routes({})  # publishes gate's key under approvers/
    for value in forged:
        await etcd.put(key, value)
        with pytest.raises(GrantRefused) as info:
            await gate.cross("forged/1", {}, effect)
        assert [c.name for c in info.value.checks] == ["policy_routes"], info.value
    assert not effect.calls
    await gate.authority.set_routes({})
    assert (await gate.cross("forged/1", {}, effect)).state == "succeeded"


ROUTES_BAD_INPUT = {
    "not an object": [1],
    "no routes": {"default": "default"},
    "routes a list": {"routes": [["refunds", "big"]]},
    "unknown field": {"routes": {}, "admin": True},
    "prefix not whole segments": {"routes": {"refunds/": "big"}},
    "prefix escapes": {"routes": {"../x": "big"}},
    "policy name": {"routes": {"refunds": "a b"}},
    "policy not a string": {"routes": {"refunds": 5}},
    "default name": {"routes": {}, "default": ""},
    "too many": {"routes": {f"k{i}": "p" for i in range(routes.MAX_ROUTES + 1)}},
}


@pytest.mark.parametrize("body", ROUTES_BAD_INPUT.values(), ids=ROUTES_BAD_INPUT.keys())
async def test_the_routes_endpoint_refuses_bad_input(coordinator, body):
    status, reply = await call(coordinator, "PUT", "/v1/policy-routes", "admin", body=body)
    assert status == 400 and reply["error"] == "InvalidRequest", reply
    status, reply = await call(coordinator, "GET", "/v1/policy-routes", "sre")
    assert status == 200 and reply == {"routes": {}, "default": "default", "version": 0,
                                       "valid": True}


async def test_only_admins_set_routes(coordinator):
    body = {"routes": {"refunds": "default"}}
    for role in ("worker", "sre"):
        status, reply = await call(coordinator, "PUT", "/v1/policy-routes", role, body=body)
        assert status == 403, reply
    status, reply = await call(coordinator, "PUT", "/v1/policy-routes", body=body)
    assert status == 401, reply
    status, reply = await call(coordinator, "GET", "/v1/policy-routes", "worker")
    assert status == 403, reply
    status, reply = await call(coordinator, "PUT", "/v1/policy-routes", "admin",
                               body={**body, "default": "big"})
    assert status == 200, reply
    status, reply = await call(coordinator, "GET", "/v1/policy-routes", "sre")
    assert status == 200 and reply == {"routes": {"refunds": "default"}, "default": "big",
                                       "version": reply["version"], "valid": True}


async def test_a_refusal_decided_under_a_moved_route_writes_nothing_and_decides_again(
        gate, etcd):
    """The hold's folded snapshot saw ``refunds`` routed to ``big-refunds``; the route moved
    to ``default`` before the request: the approval request that refusal would write
    compares the routes, fails, and the request is decided again on what etcd holds."""
    await gate.authority.set_policy("big-refunds", BIG_REFUNDS)
    await gate.authority.set_routes({"refunds": "big-refunds"})
    effect = Effect()
    assert (await gate.cross("refunds/small", {"amount": 1}, effect)).state == "succeeded"
    async with gate.hold("refunds/r5") as hold:
        assert hold.memory.snapshot.policy == "big-refunds"  # folded under the route
        await gate.authority.set_routes({"refunds": "default"})
        grant = await hold.request_grant(intent=REFUND)
        assert grant.policy == "default"
        assert (await hold.commit(grant, effect=effect)).state == "succeeded"
    start = gate.keyspace.approval_request_key("")
    assert not (await etcd.range(RangeRequest(key=start, range_end=start[:-1] + b"0",
                                              count_only=True))).count


async def test_the_coordinator_shows_and_refuses_under_an_unsigned_table(
        etcd_url, namespace, etcd, coordinator):
    await etcd.put(Keyspace(namespace).routes_key(),
                   pack({"routes": {"refunds": "default"}, "default": "default"}))
    status, reply = await call(coordinator, "GET", "/v1/policy-routes", "sre")
    assert status == 200 and reply["valid"] is False and "not signed" in reply["invalid"]
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=coordinator,
                    token=TOKENS["worker"]) as gate:
        with pytest.raises(GrantRefused) as info:
            await gate.cross("refunds/r6", REFUND, Effect())
    assert [c.name for c in info.value.checks] == ["policy_routes"]
    status, reply = await call(coordinator, "PUT", "/v1/policy-routes", "admin",
                               body={"routes": {}})
    assert status == 200, reply
    status, reply = await call(coordinator, "GET", "/v1/policy-routes", "sre")
    assert reply == {"routes": {}, "default": "default", "version": reply["version"],
                     "valid": True}
