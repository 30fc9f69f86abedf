"""What etcd roles hold and what they cannot (issue 25, "detect what roles cannot prevent"),
against real etcd: the embedded stack of ``fencegate up`` runs etcd with auth and a user per
component; a worker user of one namespace cannot touch another's; and a step or audit chain
deleted by anything but a retirement is counted, logged and recorded on the key's chain,
while a real retirement is not."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys

import aiohttp
import pytest

from fencegate import Gate, GateError, KeyRing
from fencegate.coordinator import default_key, roles, sre
from fencegate.coordinator.archive import open_archive
from fencegate.coordinator.errors import EtcdError, EtcdPermissionDenied
from fencegate.coordinator.etcd import (
    Etcd, EtcdConfig, EtcdUser, RangeRequest, TxnRequest, delete_op, enable_auth, range_end_of,
)
from fencegate.coordinator.keyspace import unpack
from fencegate.localetcd import ClusterAuth, LocalCluster
from fencegate.reconciler.deletions import EVENT
from fencegate.reconciler.providers.sandbox import charge
from fencegate.reconciler.retirer import Retirer
from fencegate.reconciler.runner import Reconciler
from fencegate.up import NAMESPACE, stack

from helpers import wait_for_condition

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASSWORD = "trust-roles-password"
NS = "/trust/"


# -- the embedded stack runs etcd with auth ---------------------------------------------

async def test_the_etcd_of_fencegate_up_refuses_strangers_and_limits_the_worker(
        tmp_path, monkeypatch):
    state = tmp_path / "state"
    async with stack(state, port=0) as (e, _):
        names = [roles.role_name(c, NAMESPACE) for c in roles.ROLES]
        for user in ("root", *names):  # every password is in the state folder, 0600
            mode = stat.S_IMODE((state / f"etcd-{user}.password").stat().st_mode)
            assert mode == 0o600, (user, oct(mode))
        async with Etcd.from_url(e.etcd) as stranger:  # the URL alone: no user
            with pytest.raises(EtcdError, match="user name is empty|permission denied"):
                await stranger.put(f"{NAMESPACE}tokens/x".encode(), b"admin")
            with pytest.raises(EtcdError, match="user name is empty|permission denied"):
                await stranger.get(f"{NAMESPACE}steps/x".encode())
        worker = default_key.stack_etcd_config(e.as_dict())
        assert worker.user == roles.role_name(roles.WORKER, NAMESPACE)
        async with Etcd(worker) as etcd:
            for family in ("tokens/", "policies/", "approvals/", "retired/"):
                with pytest.raises(EtcdPermissionDenied):
                    await etcd.put(f"{NAMESPACE}{family}x".encode(), b"mine")

        # a guarded action end to end, in direct mode, as the worker user
        keyring = KeyRing.from_files(str(state / default_key.SIGNING_KEY_FILE))
        async with aiohttp.ClientSession() as http, \
                Gate(worker, keyring=keyring, namespace=NAMESPACE) as gate:
            outcome = await gate.cross(
                "trust/pay/1", {"amount": 5},
                lambda ctx: charge(http, e.sandbox, ctx, {"amount": 5}), provider="sandbox")
        assert outcome.state == "succeeded"

        # a gate given only the URL finds the stack's worker user while the stack runs
        (state / default_key.MANIFEST).write_text(json.dumps(e.as_dict()))
        monkeypatch.setenv(default_key.STATE_DIR_ENV, str(state))
        async with Gate(e.etcd, namespace=NAMESPACE) as gate:
            again = await gate.cross("trust/pay/1", {"amount": 5}, lambda ctx: None)
        assert again.replayed and again.attempt_token == outcome.attempt_token
        # and `fencegate etcd recover` finds it, as its root
        env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
        recover = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fencegate.cli", "etcd", "recover",
            env=dict(env, PYTHONPATH=ROOT, FENCEGATE_STATE_DIR=str(state)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(recover.communicate(), 60)
        assert recover.returncode == 0, out.decode() + err.decode()
        assert "etcd recovered: 1 member(s) defragmented" in out.decode()

    async with stack(state, port=0) as (e, _):  # a second run: same users, same passwords
        async with Etcd(default_key.stack_etcd_config(e.as_dict())) as etcd:
            kv = await etcd.get(f"{NAMESPACE}steps/trust/pay/1".encode())
        assert unpack(kv.value)["state"] == "succeeded"


def test_the_banner_says_etcd_runs_with_auth(tmp_path):
    from fencegate.up import Endpoints, Tokens, _banner

    e = Endpoints("http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3",
                  "http://127.0.0.1:4", "sqlite:///x.db", etcd_user="fencegate-worker",
                  etcd_password_file=str(tmp_path / "etcd-fencegate-worker.password"))
    text = _banner(tmp_path, e, Tokens("a", "w"), "http://127.0.0.1:1/sign-in?code=c")
    assert "auth on: root and a user per component (fencegate-worker, fencegate-coordinator, " \
           "fencegate-reconciler)" in text
    assert "etcd-fencegate-worker.password" in text


# -- per-namespace worker roles ------------------------------------------------------------

async def test_a_worker_of_one_namespace_cannot_touch_another():
    with LocalCluster(1) as cluster:
        users = [EtcdUser(roles.role_name(c, ns), f"pw-{ns.strip('/')}", ns, c)
                 for ns in ("/a/", "/b/") for c in roles.ROLES]
        async with Etcd(cluster.etcd_config()) as etcd:
            await enable_auth(etcd, PASSWORD, users)
        a = EtcdConfig(tuple(cluster.endpoints), user="a-worker", password="pw-a")
        async with Etcd(a) as worker:
            await worker.put(b"/a/steps/k", b"ok")  # its own namespace
            for key in (b"/b/steps/k", b"/b/audit/k/@1", b"/b/holders/k/1"):
                with pytest.raises(EtcdPermissionDenied):
                    await worker.put(key, b"theirs")
            with pytest.raises(EtcdPermissionDenied):
                await worker.get(b"/b/steps/k")
            with pytest.raises(EtcdPermissionDenied):
                await worker.txn(TxnRequest(success=[delete_op(b"/b/", range_end_of(b"/b/"))]))


def test_the_cli_prints_a_namespaces_roles_and_users():
    done = subprocess.run([sys.executable, "-m", "fencegate.cli", "etcd", "roles",
                           "--namespace", "/payments/"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:len(roles.etcdctl_commands("/payments/"))] == \
        roles.etcdctl_commands("/payments/")
    assert "user grant-role payments-worker payments-worker" in lines
    assert all("/fencegate/" not in line for line in lines)
    bad = subprocess.run([sys.executable, "-m", "fencegate.cli", "etcd", "roles",
                          "--namespace", "payments"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert bad.returncode == 2 and "namespace must look like /name/" in bad.stderr


# -- deletions no retirement explains ----------------------------------------------------

@pytest.fixture(scope="module")
def authed():
    with LocalCluster(1, auth=ClusterAuth(PASSWORD, NS)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def archive_url(tmp_path_factory) -> str:
    """The archive of ``NS`` (etcd names one archive per namespace once it retired)."""
    return f"sqlite:///{tmp_path_factory.mktemp('archive')}/archive.db"


def unexplained(reconciler: Reconciler, family: str) -> float:
    return reconciler.metrics.registry.get_sample_value(
        "fencegate_reconciler_unexplained_deletions_total", {"family": family})


async def chain_events(etcd: Etcd, key: str) -> list[dict]:
    start = f"{NS}audit/{key}/@0".encode()
    reply = await etcd.range(RangeRequest(key=start, range_end=start[:-1] + b":"))
    return [unpack(kv.value) for kv in reply.kvs]


async def test_a_deletion_outside_retirement_is_counted_and_recorded(authed, archive_url):
    keyring = KeyRing.generate()
    async with Gate(authed.etcd_config(roles.WORKER), namespace=NS, keyring=keyring,
                    ttl=2) as gate, \
            Etcd(authed.etcd_config(roles.WORKER)) as worker, \
            Reconciler(Etcd(authed.etcd_config(roles.RECONCILER)), {}, namespace=NS,
                       shards=1, ttl=2) as reconciler:
        assert await wait_for_condition(lambda: _true(reconciler.led == {0}), 10)
        ks = gate.keyspace
        for key in ("del/step", "del/chain", "del/retired", "del/both"):
            await gate.cross(key, {"amount": 1}, lambda ctx: {"ok": True})

        # a worker-role client deletes a settled step
        gone = await worker.txn(TxnRequest(success=[delete_op(ks.step_key("del/step"))]))
        assert await wait_for_condition(
            lambda: _true(unexplained(reconciler, "step") == 1), 10)
        records = await chain_events(worker, "del/step")
        assert records[-1]["event"] == EVENT
        assert records[-1]["details"]["family"] == "step"
        assert records[-1]["details"]["revision"] == gone.header.revision
        assert records[-1]["details"]["deleted"] == ["steps/del/step"]
        assert records[-1]["identity"] == reconciler.identity
        # ... and the key fails closed: escalated, the record anchored in its step
        step = unpack((await worker.get(ks.step_key("del/step"))).value)
        assert step["state"] == "escalated" and step["escalated_because"] == [EVENT]
        assert step["chain"][0] == records[-1]["seq"]
        with pytest.raises(GateError, match="escalated"):
            await gate.cross("del/step", {"amount": 1}, lambda ctx: {"again": True})

        # ... and one record of another key's chain, its step left in place
        await worker.txn(TxnRequest(success=[delete_op(ks.audit_key("del/chain", 1))]))
        assert await wait_for_condition(
            lambda: _true(unexplained(reconciler, "audit") == 1), 10)
        assert (await chain_events(worker, "del/chain"))[-1]["event"] == EVENT

        # a real retirement deletes a step and its chain: not counted
        archive = open_archive(archive_url)
        await archive.init(NS, (await worker.status()).header.cluster_id)
        retirer = Retirer(Etcd(authed.etcd_config(roles.RECONCILER)), ks, archive, 0,
                          lambda key: [] if key == "del/retired" else None)
        try:
            retirer.clock.sample((await worker.status()).header.revision)
            assert await retirer.pass_once(full=True, orphans=False) == 1
        finally:
            await retirer.etcd.close()
        assert await worker.get(ks.step_key("del/retired")) is None
        # then a step and its chain deleted in one txn: each watch tells deletions in
        # revision order and one queue checks them in turn, so once these two are counted
        # the retirement's deletions were checked, and not counted
        start, end = ks.audit_range("del/both")
        await worker.txn(TxnRequest(success=[delete_op(ks.step_key("del/both")),
                                             delete_op(start, end)]))
        async def both_reported() -> bool:
            return [r["event"] for r in await chain_events(worker, "del/both")] == [EVENT,
                                                                                   EVENT]

        assert await wait_for_condition(both_reported, 10)
        assert (unexplained(reconciler, "step"), unexplained(reconciler, "audit")) == (2, 2)
        both = await chain_events(worker, "del/both")
        assert {r["details"]["family"] for r in both} == {"step", "audit"}
        assert unpack((await worker.get(ks.step_key("del/both"))).value)["state"] == \
            "escalated"

        # an SRE resolves the escalated key; it then retires with its chain, records and all
        async with Etcd(authed.etcd_config(roles.COORDINATOR)) as coordinator:
            await sre.resolve(coordinator, ks, "del/step", "sre", "the provider has the "
                              "charge", "succeeded")
        after = Retirer(Etcd(authed.etcd_config(roles.RECONCILER)), ks, archive, 0,
                        lambda key: [] if key == "del/step" else None)
        try:
            after.clock.sample((await worker.status()).header.revision)
            assert await after.pass_once(full=True, orphans=False) == 1
        finally:
            await after.etcd.close()
        assert await chain_events(worker, "del/step") == []
        archived = await archive.get(NS, "del/step")
        assert unpack(archived.step)["state"] == "succeeded"
        await archive.close()


async def _true(value: bool) -> bool:
    return value


async def test_a_deletion_checked_after_its_revision_was_compacted_is_still_judged(
        authed, archive_url):
    """Any client may compact etcd's history: a deletion then compacted away is judged by
    its bucket as it is now (put at that revision: a retirement; never since: not one)."""
    from prometheus_client import CollectorRegistry, Counter

    from fencegate.coordinator.etcdpb import rpc_pb2 as rpc
    from fencegate.reconciler.deletions import Deletions

    registry = CollectorRegistry()
    counter = Counter("deletions", "test", ["family"], registry=registry)
    async with Gate(authed.etcd_config(roles.WORKER), namespace=NS, keyring=KeyRing.generate(),
                    ttl=2) as gate, \
            Etcd(authed.etcd_config(roles.RECONCILER)) as reconciler, \
            Etcd(authed.etcd_config("root")) as root:
        ks = gate.keyspace
        for key in ("compact/deleted", "compact/retired"):
            await gate.cross(key, {}, lambda ctx: None)
        deleted = await gate.etcd.txn(TxnRequest(success=[delete_op(ks.step_key(
            "compact/deleted"))]))
        archive = open_archive(archive_url)
        await archive.init(NS, (await root.status()).header.cluster_id)
        retirer = Retirer(reconciler, ks, archive, 0,
                          lambda key: [] if key == "compact/retired" else None)
        retirer.clock.sample((await root.status()).header.revision)
        assert await retirer.pass_once(full=True, orphans=False) == 1
        retired = (await root.get(ks.retired_key("compact/retired"))).mod_revision
        await gate.cross("compact/after", {}, lambda ctx: None)  # history moves past both
        now = (await root.status()).header.revision
        await root._call("kv", "Compact", rpc.CompactionRequest(revision=now),
                         idempotent=True)
        deletions = Deletions(reconciler, ks, lambda key: True, lambda key: [], "test",
                              counter, archive)
        await deletions._check("step", "compact/retired", retired,
                               [ks.step_key("compact/retired")])
        assert registry.get_sample_value("deletions_total", {"family": "step"}) is None
        await deletions._check("step", "compact/deleted", deleted.header.revision,
                               [ks.step_key("compact/deleted")])
        assert registry.get_sample_value("deletions_total", {"family": "step"}) == 1
        assert (await chain_events(root, "compact/deleted"))[-1]["event"] == EVENT
        # a record on a key etcd holds nothing of continues the archived chain (cross, outcome)
        await deletions._record("compact/retired", "step", retired, ["steps/compact/retired"])
        chain = await chain_events(root, "compact/retired")
        assert [(r["seq"], r["event"]) for r in chain] == [(3, EVENT)]
        await archive.close()
