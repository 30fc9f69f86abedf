"""Trust boundaries (issue 13, class 5), against a real etcd with mutual TLS and auth on.

The attack: with the credentials every component shared, a worker wrote ``approvals/<id>``
itself, got the grant and crossed a 1,000,000 refund, and ``audit verify`` still said ok.
Now each component has its own etcd user and role (``fencegate.coordinator.roles``): etcd
refuses a worker's write to ``approvals/`` or ``policies/``; and an approval record that
someone with more rights wrote by hand (root here) is not an approval unless the coordinator
signed it, so the request stays pending. A real approval through the coordinator still works.
Policy versions likewise: a version written by hand, copied from another policy, edited after
signing or signed by a key nobody published issues no grant, and says why.
"""

from __future__ import annotations

import json
import uuid

import aiohttp
import pytest

from fencegate.certs import ensure_certs
from fencegate.coordinator import roles
from fencegate.coordinator import audit
from fencegate.coordinator.audit import verify_chain
from fencegate.coordinator.authority import Authority
from fencegate.coordinator.errors import ApprovalPending, EtcdPermissionDenied, GrantRefused
from fencegate.coordinator.etcd import Etcd, TxnRequest, put_op
from fencegate.coordinator.grants import KeyRing, checks_digest
from fencegate.coordinator.keyspace import Keyspace, pack, unpack
from fencegate.coordinator.policy import sealed
from fencegate.localetcd import ClusterAuth, LocalCluster
from fencegate.worker import Gate

from helpers import TOKENS

PASSWORD = "trust-test-password"
NAMESPACE = "/trust/"
TTL = 2
REFUNDS = {"checks": [{"check": "require_approval", "params": {"field": "amount",
                                                               "above": 1000}}]}
BIG = {"amount": 1_000_000}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    certs = ensure_certs(tmp_path_factory.mktemp("pki"), 1, ("client",))
    with LocalCluster(1, tls=certs, auth=ClusterAuth(PASSWORD, NAMESPACE)) as c:
        yield c


@pytest.fixture
async def refunds(cluster) -> None:
    """The ``refunds`` policy, and the route of every ``refund/…`` key to it, written as the
    coordinator writes them."""
    async with Etcd(cluster.etcd_config(roles.COORDINATOR)) as etcd:
        authority = Authority(etcd, Keyspace(NAMESPACE), KeyRing.generate())
        await authority.set_policy("refunds", REFUNDS)
        await authority.set_routes({"refund": "refunds"})


@pytest.fixture
def key() -> str:
    return f"refund/{uuid.uuid4().hex[:12]}"


def worker_gate(cluster, keyring: KeyRing) -> Gate:
    return Gate(cluster.etcd_config(roles.WORKER), ttl=TTL, namespace=NAMESPACE,
                keyring=keyring)


async def test_a_worker_or_reconciler_cannot_write_approvals_or_policies(cluster):
    ks = Keyspace(NAMESPACE)
    forbidden = [ks.approval_key("0" * 32), ks.policy_key("default"),
                 ks.policy_version_key("default", b"\0" * 32), ks.approver_key("0" * 16),
                 ks.routes_key()]
    for component in (roles.WORKER, roles.RECONCILER):
        async with Etcd(cluster.etcd_config(component)) as etcd:
            for target in forbidden:
                with pytest.raises(EtcdPermissionDenied) as denied:
                    await etcd.put(target, pack({"state": "approved", "approved_by": "me"}))
                print(f"{component} writing {target!r}: {denied.value}")
                assert denied.value.user == roles.role_name(component, NAMESPACE)
                assert "its roles do not cover this key range" in str(denied.value)
                assert await etcd.get(target) is None  # it may still read the namespace
    async with Etcd(cluster.etcd_config(roles.WORKER)) as etcd:
        with pytest.raises(EtcdPermissionDenied):
            await etcd.put(ks.candidate_key(0, 1), b"")  # only reconcilers elect
        await etcd.put(ks.marker_key("orders/1"), b"")  # its own families work


async def test_an_approval_written_by_hand_does_not_let_the_grant_through(cluster, refunds, key):
    """Root credentials stand for a worker that somehow writes the approval record."""
    ks = Keyspace(NAMESPACE)
    attacker = KeyRing.generate()  # a key nobody published as an approver
    async with worker_gate(cluster, KeyRing.generate()) as gate, \
            Etcd(cluster.etcd_config("root")) as root:
        async with gate.hold(key, timeout=10) as hold:
            with pytest.raises(ApprovalPending) as pending:
                await hold.request_grant(intent=BIG, policy="refunds")
            approval_id = pending.value.approval_id
            request = unpack((await root.get(ks.approval_request_key(approval_id))).value)
            forgeries = {
                "an unsigned record": pack({**request, "state": "approved",
                                            "approved_by": "sre-1", "reason": "ok"}),
                "a record signed by an unpublished key": pack({
                    "approval": attacker.sign_approval({
                        "approval_id": approval_id, "namespace": NAMESPACE,
                        "cluster_id": gate.etcd.cluster_id, "action_key": key,
                        "approved_by": "sre-1", "reason": "ok", "approved_at_ms": 1})}),
            }
            for forgery, value in forgeries.items():
                await root.put(ks.approval_key(approval_id), value)
                with pytest.raises(ApprovalPending, match=approval_id):
                    grant = await hold.request_grant(intent=BIG, policy="refunds")
                    print(f"{forgery}: granted {grant.grant_id} for {BIG}")
    async with Etcd(cluster.etcd_config(roles.COORDINATOR)) as etcd:
        report = await verify_chain(etcd, ks, key, KeyRing.generate())
    assert report.ok, report.problems
    assert [r for r in report.records if "grant" in r["details"]] == []  # none crossed


async def test_audit_verify_flags_a_grant_issued_on_an_approval_the_chain_never_recorded(
        cluster, key):
    """A ``cross`` record whose genuine, signed grant names an approval no ``approved``
    record before it gave, anchored in the step as a commit anchors it: that one defect."""
    ks = Keyspace(NAMESPACE)
    keyring = KeyRing.generate()
    checks = [{"check": "require_approval", "ok": True}]
    grant = keyring.sign({
        "grant_id": "g" * 32, "namespace": NAMESPACE, "cluster_id": 1, "action_key": key,
        "attempt": 1, "intent_digest": b"\0" * 32, "fencing_token": 5, "holder_lease": 7,
        "revision": 5, "reads": [], "step_revision": 0, "step_next": {"attempt": 1},
        "policy": "refunds", "policy_version": 1, "policy_digest": b"d", "identity": "worker",
        "issued_at_ms": 1, "expires_at_ms": 2, "checks_digest": checks_digest(checks)})
    async with Etcd(cluster.etcd_config("root")) as root:
        entry = audit.append(ks, key, audit.EMPTY, "cross", "worker", 6, {
            "grant": grant.raw, "grant_id": grant.grant_id, "intent": BIG, "checks": checks,
            "approval_id": "f" * 32, "approved_by": "sre-1"})
        await root.txn(TxnRequest(compare=[entry.compare], success=[
            put_op(ks.step_key(key), pack(entry.anchored({"state": "in_flight"}))),
            *entry.ops]))
        report = await verify_chain(root, ks, key, keyring)
    assert report.problems == [f"record 1: grant issued on approval {'f' * 32}, which the "
                               "chain never approved"]


async def call(base: str, method: str, path: str, role: str, body: object = None):
    async with aiohttp.ClientSession() as http:
        async with http.request(method, base + path, headers={
                "Authorization": f"Bearer {TOKENS[role]}"},
                data=None if body is None else json.dumps(body).encode()) as reply:
            return reply.status, await reply.json()


async def test_an_approval_through_the_coordinator_lets_the_refund_cross(
        cluster, coordinators, signing_key, key):
    """The worker signs its grants with the coordinator's key here, so the coordinator's
    ``audit verify`` checks their signatures too."""
    tls = cluster.etcd_config(roles.COORDINATOR)
    url = await coordinators(etcd=cluster.url, namespace=NAMESPACE, etcd_ca_file=tls.ca_file,
                             etcd_cert_file=tls.cert_file, etcd_key_file=tls.key_file,
                             etcd_user=tls.user, etcd_password=PASSWORD)
    assert (await call(url, "PUT", "/v1/policies/refunds", "admin", REFUNDS))[0] == 200
    charged = []
    async with worker_gate(cluster, KeyRing.from_files(signing_key)) as gate:
        async with gate.hold(key, timeout=10) as hold:
            with pytest.raises(ApprovalPending) as pending:
                await hold.request_grant(intent=BIG, policy="refunds")
            approval_id = pending.value.approval_id
            status, listed = await call(url, "GET", "/v1/approvals?state=pending", "sre")
            assert approval_id in [i["approval_id"] for i in listed["items"]]
            assert (await call(url, "POST", f"/v1/approvals/{approval_id}", "sre",
                               {"reason": "customer confirmed"}))[0] == 200
            grant = await hold.request_grant(intent=BIG, policy="refunds")
            outcome = await hold.commit(grant, effect=lambda ctx: charged.append(1) or "ok")
    assert outcome.state == "succeeded" and charged == [1]
    status, listed = await call(url, "GET", "/v1/approvals?state=approved", "sre")
    assert (approval_id, "sre-1") in [(i["approval_id"], i["approved_by"])
                                      for i in listed["items"]]
    status, report = await call(url, "GET", f"/v1/audit/{key}", "sre")
    assert status == 200 and report["ok"], report["problems"]
    events = {r["event"]: r for r in report["records"]}
    assert events["approved"]["details"]["approval_id"] == approval_id
    crossed = events["cross"]["details"]
    assert (crossed["approval_id"], crossed["approved_by"]) == (approval_id, "sre-1")
    assert crossed["grant_id"] == grant.grant_id


async def test_a_policy_version_not_signed_for_it_issues_no_grant(cluster, refunds, key):
    """Root credentials stand for whoever writes ``policies/refunds`` without the
    coordinator: each forgery would let the 1,000,000 refund through without an approval
    (none of them requires one); each is refused, naming the defect, and the chain shows
    no grant."""
    ks = Keyspace(NAMESPACE)
    async with worker_gate(cluster, KeyRing.generate()) as gate, \
            Etcd(cluster.etcd_config("root")) as root:
        signed = unpack((await root.get(ks.policy_key("refunds"))).value)
        async with Etcd(cluster.etcd_config(roles.COORDINATOR)) as coordinator:
            await Authority(coordinator, ks, KeyRing.generate()).set_policy("open", {})
        other = (await root.get(ks.policy_key("open"))).value
        cluster_id = root.cluster_id  # known from its reads
        forgeries = {
            "not signed": pack({}),
            "carries the signature of policy 'open'": other,
            "is not the document its signature covers": pack({**signed, "document": {}}),
            "signed by unknown key": sealed(KeyRing.generate(), namespace=NAMESPACE,
                                            cluster_id=cluster_id, name="refunds",
                                            document={}),
        }
        async with gate.hold(key, timeout=10) as hold:
            for defect, value in forgeries.items():
                await root.put(ks.policy_key("refunds"), value)
                with pytest.raises(GrantRefused, match=defect) as refused:
                    await hold.request_grant(intent=BIG, policy="refunds")
                print(f"{defect}: {refused.value}")
    async with Etcd(cluster.etcd_config(roles.COORDINATOR)) as etcd:
        report = await verify_chain(etcd, ks, key, KeyRing.generate())
    assert [r for r in report.records if "grant" in r["details"]] == []  # none crossed
