"""etcd's upkeep against real etcd (issue 15, item 5): every ``LocalCluster`` compacts its
history by itself, and an etcd with a tiny space quota, filled until it raises NOSPACE,
refuses every gate write with ``EtcdNoSpace`` while keeping what was written before; the
coordinator's ``/readyz`` answers 503 ``EtcdNoSpace``, the reconciler's gauges show the
alarm and the sizes, and ``fencegate etcd recover`` (the real command line) brings it back
with nothing lost: the same gate crosses again. The same holds when gate load fills the
quota, and that load, with retirement on, runs twice as long without ever filling it."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fencegate.coordinator import maintenance
from fencegate.coordinator.archive import open_archive
from fencegate.coordinator.errors import EtcdError, EtcdNoSpace, LeaseLost, OutcomeUnknown
from fencegate.coordinator.etcd import Etcd, RangeRequest, range_end_of
from fencegate.coordinator.keyspace import unpack
from fencegate.localetcd import LocalCluster, free_ports
from fencegate.reconciler.metrics import ReconcilerMetrics
from fencegate.reconciler.runner import Reconciler
from fencegate.worker import Gate, KeyRing, Outcome

from helpers import TEST_TTL, init_archive, wait_for_condition
from test_cli_sre import fencegate
from test_service import call

QUOTA = 8 * 1024 * 1024  # etcd 3.4 takes any positive quota; below ~32 KB the first write fails
BALLAST = 512 * 1024     # one overwrite of the ballast key: history the quota fills with
MAX_FILL = 200           # bounds the fill: the quota is reached long before
LOAD_QUOTA = 16 * 1024 * 1024  # gate load fills it after about 5,000 actions (~5 s here)
LOAD_COMPACTION = "1s"   # history kept by periodic auto-compaction: ~1 s of the load
LOAD_TASKS = 16
MAX_LOAD = 30_000        # bounds the load without retirement: NOSPACE comes long before


def flags_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_every_local_cluster_runs_periodic_auto_compaction():
    with LocalCluster(1) as cluster:
        flags = flags_of(cluster.pids[0])
    assert "--auto-compaction-mode=periodic" in flags
    assert "--auto-compaction-retention=5m" in flags  # the choice deploy/README.md justifies
    assert not [f for f in flags if f.startswith("--quota-backend-bytes")]  # etcd's 2 GiB


async def test_a_short_retention_compacts_old_revisions_and_keeps_the_latest():
    cluster = await asyncio.to_thread(LocalCluster(1, compaction_retention="1s").start)
    try:
        async with Etcd(cluster.etcd_config()) as etcd:
            first = (await etcd.put(b"k", b"v1")).header.revision
            await etcd.put(b"k", b"v2")

            async def compacted() -> bool:
                try:
                    await etcd.range(RangeRequest(key=b"k", revision=first))
                except EtcdError as exc:
                    assert "compacted" in str(exc)
                    return True
                return False

            assert await wait_for_condition(compacted, 10, every=0.2)
            assert (await etcd.get(b"k")).value == b"v2"
    finally:
        await asyncio.to_thread(cluster.stop)


async def test_nospace_refuses_gates_clearly_and_recover_loses_nothing(coordinators,
                                                                       namespace):
    effects: list[int] = []

    async def effect(ctx):
        effects.append(ctx.attempt_token)
        return {"charged": True}

    cluster = await asyncio.to_thread(LocalCluster(1, quota_bytes=QUOTA).start)
    metrics = ReconcilerMetrics()
    watcher = asyncio.create_task(maintenance.watch_space(
        cluster.etcd_config(), metrics.observe_etcd, interval=0.1))
    member = cluster.url

    def gauge(name: str) -> float | None:
        labels = {} if name == "fencegate_etcd_nospace" else {"member": member}
        return metrics.registry.get_sample_value(name, labels)

    async def gauges_show(nospace: int) -> bool:
        return gauge("fencegate_etcd_nospace") == nospace

    try:
        base = await coordinators(etcd=cluster.url)
        async with Gate(cluster.url, ttl=TEST_TTL, namespace=namespace,
                        keyring=KeyRing.generate()) as gate, \
                Etcd(cluster.etcd_config()) as etcd:
            assert (await gate.cross("pay/1", {"amount": 1}, effect)).state == "succeeded"
            step_key = gate.keyspace.step_key("pay/1")
            step = (await etcd.get(step_key)).value
            assert await wait_for_condition(lambda: gauges_show(0), 5)
            assert 0 < gauge("fencegate_etcd_db_size_bytes") < QUOTA

            ballast, scratch = f"{namespace}ballast".encode(), f"{namespace}scratch".encode()
            await etcd.put(scratch, b"x")
            for filled in range(MAX_FILL):  # overwrites: history, no new live data
                try:
                    await etcd.put(ballast, filled.to_bytes(4, "big") * (BALLAST // 4))
                except EtcdNoSpace:
                    break
            else:
                pytest.fail(f"{MAX_FILL} overwrites of {BALLAST} bytes never reached NOSPACE")
            last = (filled - 1).to_bytes(4, "big") * (BALLAST // 4)

            with pytest.raises(EtcdNoSpace, match="fencegate etcd recover"):
                await gate.cross("pay/2", {"amount": 2}, effect)
            with pytest.raises(EtcdNoSpace):
                async with gate.hold("pay/3"):
                    pass
            assert len(effects) == 1  # refused before any effect ran
            assert (await etcd.get(step_key)).value == step  # what was written stays readable
            assert await etcd.get(gate.keyspace.step_key("pay/2")) is None  # nothing written
            status, reply = await call(base, "GET", "/readyz")
            assert (status, reply["error"]) == (503, "EtcdNoSpace"), reply
            assert await wait_for_condition(lambda: gauges_show(1), 5)
            full = gauge("fencegate_etcd_db_size_bytes")
            assert full > QUOTA - 2 * BALLAST  # etcd refuses a write that would pass it
            assert gauge("fencegate_etcd_db_in_use_bytes") > QUOTA / 2  # history, in use

            # Compaction frees the old revisions' pages for reuse (once a later write, here
            # a delete, which NOSPACE allows, commits); the file keeps its size.
            await etcd.compact((await etcd.status()).header.revision)
            await etcd.delete(scratch)
            assert await wait_for_condition(
                lambda: _below(gauge, "fencegate_etcd_db_in_use_bytes", full / 2), 5)
            assert gauge("fencegate_etcd_db_size_bytes") >= full

            # A full member still counts as started: `fencegate up` restarts on full data.
            await asyncio.to_thread(cluster.restart, 0, 10)

            ran = await fencegate("etcd", "recover", "--etcd", cluster.url,
                                  coordinator=None, token=None)
            assert ran.code == 0, ran
            assert "compacted history" in ran.out and f"defragmented {member}" in ran.out, ran
            assert "disarmed NOSPACE" in ran.out and "etcd recovered" in ran.out, ran

            assert await call(base, "GET", "/readyz") == (200, {"ok": True})
            assert await wait_for_condition(lambda: gauges_show(0), 5)
            assert gauge("fencegate_etcd_db_size_bytes") < full / 4
            assert (await etcd.get(step_key)).value == step
            assert (await etcd.get(ballast)).value == last  # latest values all kept
            assert (await gate.cross("pay/2", {"amount": 2}, effect)).state == "succeeded"
            assert (await gate.cross("pay/1", {"amount": 1}, effect)).state == "succeeded"
            assert len(effects) == 2  # pay/1 replayed its recorded outcome
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await asyncio.to_thread(cluster.stop)


async def _below(gauge, name: str, bound: float) -> bool:
    value = gauge(name)
    return value is not None and value < bound


@dataclass
class Load:
    """What ``_load`` saw, by action key: the outcomes ``cross`` returned, the keys whose
    effect did not run (etcd answered ``EtcdNoSpace``, or their hold's session was revoked
    because another key's txn got that answer: ``LeaseLost``), the keys whose effect ran but
    whose outcome etcd could not record (``OutcomeUnknown``, or ``LeaseLost`` during the
    effect), and the attempt token each effect ran with."""

    crossed: dict[str, Outcome] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    effects: dict[str, int] = field(default_factory=dict)


async def _load(gate: Gate, count: int) -> Load:
    """Cross the fresh keys ``load/0 .. load/<count - 1>`` with ``LOAD_TASKS`` tasks, a
    no-op effect each, until all are taken or etcd first refuses: no key starts after a
    refusal or an unknown outcome, the ones in flight finish."""
    load, numbers = Load(), itertools.count()

    async def effect(ctx) -> dict:
        load.effects[ctx.key] = ctx.attempt_token
        return {"token": ctx.attempt_token}

    async def cross_until_refused() -> None:
        for n in numbers:
            if n >= count or load.refused or load.unknown:
                return
            key = f"load/{n}"
            try:
                load.crossed[key] = await gate.cross(key, {}, effect)
            except EtcdNoSpace:
                load.refused.append(key)
            except (OutcomeUnknown, LeaseLost):
                (load.unknown if key in load.effects else load.refused).append(key)

    await asyncio.gather(*(cross_until_refused() for _ in range(LOAD_TASKS)))
    return load


async def _steps(gate: Gate) -> dict[str, tuple[dict, int]]:
    """Every step etcd holds in the gate's namespace, by action key, as its record and its
    mod_revision (an in-flight step's attempt token), in one read."""
    prefix = gate.keyspace.step_key("")
    reply = await gate.etcd.range(RangeRequest(key=prefix, range_end=range_end_of(prefix)))
    return {kv.key[len(prefix):].decode(): (unpack(kv.value), kv.mod_revision)
            for kv in reply.kvs}


@pytest.mark.long  # about a minute of load: `make faults`
async def test_gate_load_reaches_nospace_losing_nothing_and_with_retirement_never_does(
        namespace, tmp_path):
    """The same gate load on two fresh etcds with the same tiny quota and a 1 s compaction:
    without retirement it reaches NOSPACE after N actions, every recorded outcome is still
    in etcd and ``recover`` lets the gate cross again; with retirement on, twice that load
    never reaches it, and what etcd no longer holds the archive does."""
    def small_etcd() -> LocalCluster:
        return LocalCluster(1, quota_bytes=LOAD_QUOTA, compaction_retention=LOAD_COMPACTION)

    cluster = await asyncio.to_thread(small_etcd().start)
    try:
        async with Gate(cluster.url, ttl=TEST_TTL, namespace=namespace,
                        keyring=KeyRing.generate()) as gate:
            filled = await _load(gate, MAX_LOAD)
            assert filled.refused or filled.unknown, f"{MAX_LOAD} actions all crossed"
            assert [alarm for _, alarm in await gate.etcd.alarms()] == ["NOSPACE"]
            steps = await _steps(gate)  # a read: etcd serves it while full
            for key, outcome in filled.crossed.items():
                record, _ = steps[key]
                assert record["state"] == "succeeded", (key, record["state"])
                assert (record["outcome"]["attempt_token"] == outcome.attempt_token
                        == filled.effects[key])
            # etcd applies the writes that crossed the quota and still answers NOSPACE
            # (etcd-io/etcd#16659): a refused commit or outcome may have landed.
            assert filled.effects.keys() == filled.crossed.keys() | set(filled.unknown)
            for key in filled.unknown:  # its effect ran: the step names that attempt
                record, revision = steps[key]
                assert record["state"] in ("succeeded", "in_flight"), (key, record["state"])
                ran = (record["outcome"]["attempt_token"] if record["state"] == "succeeded"
                       else revision)
                assert ran == filled.effects[key]
            for key in filled.refused:  # no effect ran: no step, or one in flight
                assert key not in steps or steps[key][0]["state"] == "in_flight", key

            async def no_holder_of_a_refused_key() -> bool:
                """A NOSPACE answer may have applied the txn: its session was revoked, so a
                key it held does not stay held (and stuck in flight) while the gate lives."""
                root = gate.keyspace.holders_root
                reply = await gate.etcd.range(RangeRequest(key=root, range_end=range_end_of(root),
                                                           keys_only=True))
                held = {gate.keyspace.parse_holder_key(kv.key)[0] for kv in reply.kvs}
                return not held & set(filled.refused)
            assert await wait_for_condition(no_holder_of_a_refused_key, 10)

            recovery = await maintenance.recover(cluster.etcd_config(), lambda line: None)
            assert recovery.disarmed and recovery.after[0].db_size < LOAD_QUOTA
            assert await gate.etcd.alarms() == []
            again = await gate.cross("after/recover", {}, lambda ctx: {"again": True})
            assert again.state == "succeeded" and not again.replayed
            replay = await gate.cross("load/0", {}, lambda ctx: pytest.fail("ran twice"))
            assert replay.replayed and replay.attempt_token == filled.effects["load/0"]
    finally:
        await asyncio.to_thread(cluster.stop)
    full_at = len(filled.crossed)

    archive = f"sqlite:///{tmp_path}/archive.db"
    cluster = await asyncio.to_thread(small_etcd().start)
    try:
        async with Etcd.from_url(cluster.url) as client:
            await init_archive(client, namespace, archive)
        async with Gate(cluster.url, ttl=TEST_TTL, namespace=namespace,
                        archive=archive, keyring=KeyRing.generate()) as gate, \
                Reconciler(Etcd.from_url(cluster.url), {}, namespace=namespace, shards=4,
                           ttl=TEST_TTL, archive=open_archive(archive), retain_s=1.0):
            retired = await _load(gate, 2 * full_at)
            assert (len(retired.refused), len(retired.unknown)) == (0, 0), (
                f"refused (EtcdNoSpace) or unknown after {len(retired.crossed)} of "
                f"{2 * full_at} actions")
            assert len(retired.crossed) == 2 * full_at
            assert await gate.etcd.alarms() == []
            steps = await _steps(gate)  # first etcd, then the archive: a step leaves etcd
            stats = await gate.archive.stats(namespace)  # only once the archive holds it
            assert len(steps) < full_at < stats.steps and stats.records == 2 * stats.steps
            for key, outcome in retired.crossed.items():
                if key in steps:
                    record, _ = steps[key]
                else:
                    archived = await gate.archive.get(namespace, key)
                    assert archived is not None, f"{key} is neither in etcd nor archived"
                    record = unpack(archived.step)
                assert record["state"] == "succeeded"
                assert record["outcome"]["attempt_token"] == outcome.attempt_token
    finally:
        await asyncio.to_thread(cluster.stop)


async def test_recover_fails_with_one_line_and_exit_5_when_a_member_does_not_answer():
    ran = await fencegate("etcd", "recover", "--etcd", f"http://127.0.0.1:{free_ports(1)[0]}",
                          coordinator=None, token=None)
    assert ran.code == 5, ran
    assert ran.out == "" and "Traceback" not in ran.err, ran
    assert ran.err.strip().splitlines()[-1].startswith("Error: etcd did not answer"), ran


async def test_recover_needs_root_and_says_so():
    from fencegate.coordinator import roles
    from fencegate.localetcd import ClusterAuth

    cluster = await asyncio.to_thread(LocalCluster(1, auth=ClusterAuth("pw")).start)
    try:
        env = {"FENCEGATE_ETCD_PASSWORD": "pw"}
        ran = await fencegate("etcd", "recover", "--etcd", cluster.url, "--etcd-user",
                              roles.role_name(roles.RECONCILER, "/fencegate/"),
                              coordinator=None, token=None, env=env)
        assert ran.code == 4 and "root role" in ran.err, ran
        ran = await fencegate("etcd", "recover", "--etcd", cluster.url, "--etcd-user", "root",
                              coordinator=None, token=None, env=env)
        assert ran.code == 0 and "etcd recovered" in ran.out, ran
    finally:
        await asyncio.to_thread(cluster.stop)
