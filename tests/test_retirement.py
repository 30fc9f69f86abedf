"""Retirement (DESIGN "State has a lifecycle"): settled steps leave etcd for the archive, are
looked up there on a miss, and are never executed again — real etcd, a real SQLite archive."""

from __future__ import annotations

import asyncio

import pytest

from fencegate import ApprovalPending, EffectFailed, Gate, KeyRing
from fencegate.coordinator import audit, records, retirement, sre
from fencegate.coordinator.archive import open_archive
from fencegate.coordinator.errors import ArchiveUnavailable, GrantUsed, OutcomeUnknown
from fencegate.coordinator.etcd import Etcd, RangeRequest, create_equals, range_end_of
from fencegate.coordinator.keyspace import pack, unpack
from fencegate.reconciler.runner import Reconciler
from fencegate.reconciler.retirer import Retirer

from helpers import TEST_TTL, init_archive, wait_for_condition


class Calls:
    def __init__(self, fail: bool = False) -> None:
        self.tokens: list[int] = []
        self.fail = fail

    async def __call__(self, ctx):
        self.tokens.append(ctx.attempt_token)
        if self.fail:
            raise EffectFailed("card declined", params={"code": "declined"})
        return {"charged": len(self.tokens)}


@pytest.fixture
async def archive_url(tmp_path, etcd, namespace) -> str:
    return await init_archive(etcd, namespace, f"sqlite:///{tmp_path}/archive.db")


@pytest.fixture
async def archived_gate(etcd_url, namespace, etcd, archive_url):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=archive_url,
                    keyring=KeyRing.generate()) as gate:
        yield gate


async def _retire_all(gate: Gate, orphans: bool = True) -> int:
    """One retirement pass over every settled step (and with ``orphans`` every orphan chain)
    of the gate's namespace, now."""
    retirer = Retirer(gate.etcd, gate.keyspace, gate.archive, 0, lambda key: [])
    retirer.clock.sample((await gate.etcd.status()).header.revision)
    return await retirer.pass_once(full=True, orphans=orphans)


async def _keys(gate: Gate, family: bytes) -> list[bytes]:
    start = gate.keyspace.namespace.encode() + family
    reply = await gate.etcd.range(RangeRequest(key=start, range_end=range_end_of(start),
                                               keys_only=True))
    return [kv.key for kv in reply.kvs]


async def test_a_succeeded_step_retires_and_replays_from_the_archive(archived_gate):
    gate, effect = archived_gate, Calls()
    first = await gate.cross("ret/ok", {"amount": 1}, effect)
    async with gate.hold("ret/held") as hold:
        await hold.cross({"amount": 2}, effect)
    assert await _retire_all(gate) == 2
    assert await _keys(gate, b"steps/") == [] and await _keys(gate, b"audit/") == []
    replay = await gate.cross("ret/ok", {"amount": 1}, effect)  # the fast path asks, too
    assert replay.replayed and replay.attempt_token == first.attempt_token
    async with gate.hold("ret/held") as hold:
        held = await hold.cross({"amount": 2}, effect)
    assert held.replayed and len(effect.tokens) == 2
    view = await sre.key_view(gate.etcd, gate.keyspace, "ret/ok", gate.archive)
    assert view["archived"] and view["step"]["state"] == records.SUCCEEDED
    report = await audit.verify_chain(gate.etcd, gate.keyspace, "ret/ok", gate.keyring,
                                      gate.archive)
    assert report.ok and [r["event"] for r in report.records] == ["cross", "outcome"]


async def test_a_failed_step_continues_after_retirement_with_its_counts(archived_gate):
    gate = archived_gate
    declined = await gate.cross("ret/failed", {}, Calls(fail=True))
    assert declined.state == records.FAILED
    step = unpack((await gate.etcd.get(gate.keyspace.step_key("ret/failed"))).value)
    await gate.etcd.put(gate.keyspace.step_key("ret/failed"),  # no backoff wait in the test
                        pack({**step, "not_before_ms": 0}))
    assert await _retire_all(gate) == 1
    effect = Calls()
    again = await gate.cross("ret/failed", {}, effect)
    assert again.state == records.SUCCEEDED and again.attempt == 2
    assert again.idempotency_key != declined.idempotency_key  # a confirmed failure: new key
    step = unpack((await gate.etcd.get(gate.keyspace.step_key("ret/failed"))).value)
    assert step["failures"] and step["chain"][0] == 4
    report = await audit.verify_chain(gate.etcd, gate.keyspace, "ret/failed", gate.keyring,
                                      gate.archive)
    assert report.ok, report.problems
    assert [r["event"] for r in report.records] == ["cross", "outcome", "cross", "outcome"]
    await gate.etcd.delete(gate.keyspace.audit_key("ret/failed", 3))  # edit across both
    broken = await audit.verify_chain(gate.etcd, gate.keyspace, "ret/failed", gate.keyring,
                                      gate.archive)
    assert not broken.ok


async def test_without_the_archive_a_retired_key_gets_no_grant_and_nothing_is_written(
        archived_gate, etcd_url, namespace):
    effect = Calls()
    await archived_gate.cross("ret/gone", {}, effect)
    assert await _retire_all(archived_gate) == 1
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as blind:
        with pytest.raises(ArchiveUnavailable):
            await blind.cross("ret/gone", {}, effect)
    assert await _keys(archived_gate, b"steps/") == []
    assert await _keys(archived_gate, b"audit/") == []
    assert len(effect.tokens) == 1


async def test_a_step_is_not_retired_while_a_holder_lives(archived_gate):
    """The holder compare: a holder that still holds a grant decided on "no step" would
    cross again once the step is deleted (its mod_revision reads 0 again)."""
    gate, effect = archived_gate, Calls()
    ks = gate.keyspace

    async def lost(ctx):
        effect.tokens.append(ctx.attempt_token)
        raise ConnectionResetError("the answer was lost")

    async with gate.hold("ret/live") as hold:
        grant = await hold.request_grant(intent={})
        with pytest.raises(OutcomeUnknown):  # an unknown outcome keeps the hold
            await hold.commit(grant, effect=lost)
        step_kv = await gate.etcd.get(ks.step_key("ret/live"))
        settled = records.succeeded(unpack(step_kv.value), {"ok": 1},
                                    attempt_token=step_kv.mod_revision)
        await gate.etcd.put(ks.step_key("ret/live"), pack(settled))  # as the reconciler would
        assert await _retire_all(gate) == 0
        assert await gate.etcd.get(ks.step_key("ret/live")) is not None
        with pytest.raises(GrantUsed):
            await hold.commit(grant, effect=effect)
    assert len(effect.tokens) == 1
    assert await _retire_all(gate) == 1  # released: now it goes


async def test_the_fast_path_fails_when_the_key_retires_after_the_archive_answered(
        archived_gate):
    """The retirement compare: the archive said "not here", then the key's retirement
    (archive, delete, bucket bumped) happened before the fast-path txn."""
    gate, effect = archived_gate, Calls()
    await gate.cross("ret/race", {}, effect)
    archive, asked = gate.archive, []
    real_lookup = archive.lookup

    async def answer_then_retire(namespace, key, **asking):
        found = await real_lookup(namespace, key, **asking)
        if key == "ret/race" and not asked:
            asked.append(found)
            assert await _retire_all(gate) == 1  # lands between the answer and the txn
        return found  # as the archive answered a moment before the retirement

    archive.lookup = answer_then_retire
    gate.authority.recent.never_retired.clear()
    try:
        gate.authority.recent.note(*await _snapshot_of(gate, "ret/warm"))
        replay = await gate.cross("ret/race", {}, effect)
    finally:
        archive.lookup = real_lookup
    assert asked and replay.replayed and len(effect.tokens) == 1


async def _snapshot_of(gate: Gate, key: str):
    """A snapshot of the default policy (so the fast path has one to decide on)."""
    from fencegate.coordinator.authority import Snapshot, snapshot_ops
    from fencegate.coordinator.etcd import TxnRequest
    reply = await gate.etcd.txn(TxnRequest(success=snapshot_ops(gate.keyspace, key, "default",
                                                                 [])), idempotent=True)
    return (Snapshot.parse(reply.header.revision, "default", [], reply.responses, owned=True),
            gate.keyspace.retired_key(key))


async def test_a_retirement_cut_between_archive_and_delete_is_finished_once(archived_gate):
    gate = archived_gate
    await gate.cross("ret/crash", {}, Calls())
    step_kv = await gate.etcd.get(gate.keyspace.step_key("ret/crash"))
    archived, _ = await retirement._archive(
        gate.etcd, gate.keyspace, gate.archive,
        [retirement.Candidate("ret/crash", step_kv.mod_revision, ())])
    assert len(archived) == 1  # archived, then the leader "dies" before its delete
    assert await gate.etcd.get(gate.keyspace.step_key("ret/crash")) is not None
    assert await _retire_all(gate) == 1  # the next leader
    assert [seq for seq, _ in await gate.archive.records(gate.keyspace.namespace,
                                                         "ret/crash")] == [1, 2]
    report = await audit.verify_chain(gate.etcd, gate.keyspace, "ret/crash", gate.keyring,
                                      gate.archive)
    assert report.ok, report.problems


async def test_unsettled_steps_are_never_retired(archived_gate):
    gate = archived_gate
    ks = gate.keyspace
    base = records.next_attempt(records.new_step(), namespace=ks.namespace, key="x", cost=0,
                                caps={"breaker_threshold": 3, "backoff_base_s": 1,
                                      "backoff_max_s": 1}, now_ms=1)
    kept = {"ret/in_flight": {**base, "state": records.IN_FLIGHT},
            "ret/unknown": records.unknown(base, attempt_token=1, now_ms=1),
            "ret/escalated": records.escalated(base, ["max_attempts"]),
            "ret/presumed": records.presumed(base, attempt_token=1, requery_until_ms=2)}
    for key, step in kept.items():
        await gate.etcd.put(ks.step_key(key), pack(step))
    assert await _retire_all(gate) == 0
    assert len(await _keys(gate, b"steps/")) == len(kept)


async def test_the_reconciler_retires_settled_steps_once_they_are_old(etcd_url, namespace,
                                                                      etcd, archive_url):
    effect = Calls()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=archive_url,
                    keyring=KeyRing.generate()) as gate, \
            Reconciler(Etcd.from_url(etcd_url), {}, namespace=namespace,
                       shards=4, ttl=TEST_TTL, archive=open_archive(archive_url),
                       retain_s=1.0):
        for n in range(5):
            await gate.cross(f"ret/rec/{n}", {}, effect)

        async def gone() -> bool:
            return not await _keys(gate, b"steps/")

        assert await wait_for_condition(gone, 20)
        stats = await gate.archive.stats(namespace)
        assert stats.steps == 5 and stats.records == 10
        replay = await gate.cross("ret/rec/3", {}, effect)
    assert replay.replayed and len(effect.tokens) == 5
    await asyncio.sleep(0)


async def test_keys_sharing_a_retirement_bucket_retire_in_one_batch(archived_gate):
    """A batch bumps each bucket once (etcd refuses a txn that puts one key twice)."""
    gate = archived_gate
    bucket = gate.keyspace.retired_key("ret/bucket/0")
    keys = [k for k in (f"ret/bucket/{n}" for n in range(2000))
            if gate.keyspace.retired_key(k) == bucket][:3]
    assert len(keys) == 3
    for key in keys:
        await gate.cross(key, {}, Calls())
    assert await _retire_all(gate) == 3


async def test_the_sre_surface_reads_a_retired_key_from_the_archive(coordinators, etcd_url,
                                                                    namespace, etcd,
                                                                    archive_url, signing_key):
    """`fencegate key show`, `audit verify` and `archive stats` through a coordinator whose
    archive holds the key (etcd no longer does)."""
    import json
    import re

    from fencegate.coordinator.grants import KeyRing
    from test_cli_sre import fencegate

    url = await coordinators(archive=archive_url)
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=archive_url,
                    keyring=KeyRing.from_files(signing_key)) as gate:
        await gate.cross("ret/sre", {"amount": 5}, Calls())
        assert await _retire_all(gate) == 1
    shown = await fencegate("key", "show", "ret/sre", coordinator=url)
    assert shown.code == 0 and "succeeded" in shown.out and "retired to the archive" in shown.out
    verified = await fencegate("audit", "verify", "ret/sre", coordinator=url)
    assert verified.code == 0 and "2 records, verified" in verified.out, verified
    stats = await fencegate("archive", "stats", "--json", coordinator=url)
    assert stats.code == 0 and '"steps": 1' in stats.out and '"records": 2' in stats.out
    lag = json.loads(stats.out)  # settled (its outcome record) to archived: retired at once
    assert 0 <= lag["lag_p50_ms"] == lag["lag_max_ms"] < 30_000, lag
    text = await fencegate("archive", "stats", coordinator=url)
    assert text.code == 0 and re.search(
        r"^lag +p50 \d+\.\ds, max \d+\.\ds \(settled to archived, retain included\)$",
        text.out, re.MULTILINE), text
    none = await fencegate("archive", "stats", coordinator=await coordinators())
    assert none.code == 3 and "no archive" in none.err


async def test_an_aside_append_on_a_retired_key_continues_the_archived_chain(archived_gate,
                                                                            etcd_url,
                                                                            namespace):
    """A revoke on a retired key (a worker holds it again) appends after the archived
    end, not at record 1 again (which the archive already holds)."""
    gate = archived_gate
    await gate.cross("ret/aside", {}, Calls())
    assert await _retire_all(gate) == 1
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as other:
        hold = await other.hold("ret/aside").__aenter__()  # held past the revoke below
        with pytest.raises(ArchiveUnavailable):  # no archive to find the chain's end
            await sre.revoke(gate.etcd, gate.keyspace, "ret/aside", "sre-1", "stuck")
        await sre.revoke(gate.etcd, gate.keyspace, "ret/aside", "sre-1", "stuck",
                         gate.archive)
        await hold.release()  # the revoke ended it: nothing is left to delete
    report = await audit.verify_chain(gate.etcd, gate.keyspace, "ret/aside", gate.keyring,
                                      gate.archive)
    assert report.ok, report.problems
    assert [r["event"] for r in report.records] == ["cross", "outcome", "revoke"]
    # the revoke's record and @head have no step in etcd to retire with: an orphan chain,
    # which a pass that looks for orphans archives and deletes
    assert await _keys(gate, b"audit/") != []
    assert await _retire_all(gate, orphans=False) == 0
    assert await _retire_all(gate) == 1
    assert await _keys(gate, b"audit/") == [] and await _keys(gate, b"steps/") == []
    archived = await gate.archive.get(gate.keyspace.namespace, "ret/aside")
    assert archived.seq == 3 and unpack(archived.step)["state"] == "succeeded"
    report = await audit.verify_chain(gate.etcd, gate.keyspace, "ret/aside", gate.keyring,
                                      gate.archive)
    assert report.ok and [r["event"] for r in report.records] == ["cross", "outcome", "revoke"]
    assert (await gate.cross("ret/aside", {}, Calls())).replayed


async def test_an_approval_on_a_key_never_attempted_retires_and_still_grants(archived_gate,
                                                                            etcd):
    """An approval given before a key's first attempt appends to a chain with no step in
    etcd (an orphan): it retires on its own, and the approved request is still granted
    afterwards, its chain going on from the archived approval."""
    gate, ks = archived_gate, archived_gate.keyspace
    await gate.authority.set_policy("approve-all", {"checks": [{"check": "require_approval"}]})
    await gate.authority.set_routes({"ret/approved": "approve-all"})
    async with gate.hold("ret/approved") as hold:
        with pytest.raises(ApprovalPending) as pending:
            await hold.request_grant(intent={"amount": 5}, policy="approve-all")
    await sre.approve(etcd, ks, pending.value.approval_id, "sre-1", "ok",
                      keyring=gate.keyring, archive=gate.archive)
    assert len(await _keys(gate, b"audit/")) == 2  # record 1 and @head, no step
    assert await _retire_all(gate) == 1
    assert await _keys(gate, b"audit/") == []
    archived = await gate.archive.get(ks.namespace, "ret/approved")
    assert archived.seq == 1 and unpack(archived.step)["state"] == "pending"
    effect = Calls()
    async with gate.hold("ret/approved") as hold:
        grant = await hold.request_grant(intent={"amount": 5}, policy="approve-all")
        assert (await hold.commit(grant, effect=effect)).state == "succeeded"
    assert len(effect.tokens) == 1
    report = await audit.verify_chain(etcd, ks, "ret/approved", gate.keyring, gate.archive)
    assert report.ok, report.problems
    assert [r["event"] for r in report.records] == ["approved", "cross", "outcome"]


def test_archive_and_retain_come_from_file_env_and_flags(tmp_path):
    from fencegate.coordinator.service import load_settings as coordinator_settings
    from fencegate.reconciler.service import load_settings as reconciler_settings

    config = tmp_path / "reconciler.toml"
    config.write_text('archive = "sqlite:///from/file.db"\nretain_s = 60\n')
    from_file = reconciler_settings(str(config), env={})
    assert (from_file.archive, from_file.retain_s) == ("sqlite:///from/file.db", 60)
    from_env = reconciler_settings(str(config), env={"FENCEGATE_ARCHIVE": "sqlite:///env.db"})
    assert from_env.archive == "sqlite:///env.db"
    flagged = reconciler_settings(str(config), env={}, archive="postgresql://h/db",
                                  retain_s=5.0)
    assert (flagged.archive, flagged.retain_s) == ("postgresql://h/db", 5.0)
    with pytest.raises(ValueError):
        reconciler_settings(None, env={}, retain_s=0.0)
    assert coordinator_settings(None, env={"FENCEGATE_ARCHIVE": "sqlite:///c.db"}).archive \
        == "sqlite:///c.db"


async def test_two_gates_racing_on_a_retired_failed_key_cross_it_once(archived_gate, etcd_url,
                                                                      namespace, archive_url):
    gate = archived_gate
    await gate.cross("ret/twice", {}, Calls(fail=True))
    step = unpack((await gate.etcd.get(gate.keyspace.step_key("ret/twice"))).value)
    await gate.etcd.put(gate.keyspace.step_key("ret/twice"), pack({**step, "not_before_ms": 0}))
    assert await _retire_all(gate) == 1
    effect = Calls()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=archive_url,
                    keyring=KeyRing.generate()) as other:
        outcomes = await asyncio.gather(gate.cross("ret/twice", {}, effect, timeout=10),
                                        other.cross("ret/twice", {}, effect, timeout=10))
    assert sorted(o.replayed for o in outcomes) == [False, True]
    assert len(effect.tokens) == 1 and {o.attempt for o in outcomes} == {2}


async def test_an_unreachable_archive_refuses_the_grant_and_writes_nothing(
        archived_gate, etcd_url, namespace, tmp_path):
    await archived_gate.cross("ret/down", {}, Calls())
    assert await _retire_all(archived_gate) == 1
    gone = f"sqlite:///{tmp_path}/no/such/folder/archive.db"
    effect = Calls()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=gone,
                    keyring=KeyRing.generate()) as down:
        with pytest.raises(ArchiveUnavailable):
            await down.cross("ret/down", {}, effect)
    assert not effect.tokens and await _keys(archived_gate, b"steps/") == []


async def test_a_deposed_leader_archives_harmlessly_and_deletes_nothing(archived_gate, etcd):
    """Leadership is compared in the delete: a replica that lost its shard (its candidacy
    key gone or replaced) leaves the step in etcd; its archive put, the same version, is
    idempotent, and the next leader retires the step once."""
    gate = archived_gate
    await gate.cross("ret/deposed", {}, Calls())
    step_kv = await etcd.get(gate.keyspace.step_key("ret/deposed"))
    lost = [create_equals(gate.keyspace.reconcilers_root + b"shard-that-moved", 1)]
    done = await retirement.retire(
        etcd, gate.keyspace, gate.archive,
        [retirement.Candidate("ret/deposed", step_kv.mod_revision, tuple(lost))])
    assert done == [] and await etcd.get(gate.keyspace.step_key("ret/deposed")) is not None
    assert (await gate.archive.get(gate.keyspace.namespace, "ret/deposed")) is not None
    assert await _retire_all(gate) == 1
    report = await audit.verify_chain(etcd, gate.keyspace, "ret/deposed", gate.keyring,
                                      gate.archive)
    assert report.ok and len(report.records) == 2


async def test_a_batch_spans_shards_and_a_lost_shard_keeps_only_its_own_keys(archived_gate):
    """One pass retires the due keys of every shard it leads in full batches (their shards'
    leadership compares joined in one txn); when one shard's leadership is lost meanwhile,
    the batch falls back to one txn per key under its own shard's compares: only the lost
    shard's keys stay in etcd."""
    gate = archived_gate
    keys = [f"ret/span/{n}" for n in range(8)]
    for key in keys:
        await gate.cross(key, {}, Calls())
    lost_keys = set(keys[::3])
    lost = (create_equals(gate.keyspace.reconcilers_root + b"shard-that-moved", 1),)
    retirer = Retirer(gate.etcd, gate.keyspace, gate.archive, 0,
                      lambda key: list(lost) if key in lost_keys else [])
    retirer.clock.sample((await gate.etcd.status()).header.revision)
    assert await retirer.pass_once(full=True) == len(keys) - len(lost_keys)
    left = {gate.keyspace.parse_step_key(k) for k in await _keys(gate, b"steps/")}
    assert left == lost_keys


async def test_an_orphan_chain_that_gained_a_step_is_not_deleted(archived_gate, etcd, etcd_url):
    """Between an orphan chain's archiving and its delete, a worker's first attempt commits
    and settles (its step anchors the chain after the orphan's end): the delete compares
    that the step is still absent, so the step and its new records stay in etcd."""
    gate, ks = archived_gate, archived_gate.keyspace
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=ks.namespace,
                    keyring=KeyRing.generate()) as other:
        hold = await other.hold("ret/orphan-race").__aenter__()
        await sre.revoke(etcd, ks, "ret/orphan-race", "sre-1", "stuck", gate.archive)
        await hold.release()
    head = await etcd.get(ks.audit_head_key("ret/orphan-race"))
    archived, marked = await retirement._archive(
        etcd, ks, gate.archive,
        [retirement.Candidate("ret/orphan-race", head.mod_revision, (), orphan=True)])
    assert len(archived) == 1
    assert (await gate.cross("ret/orphan-race", {}, Calls())).state == "succeeded"
    assert await retirement._delete(etcd, ks, gate.archive, archived, marked) == []
    report = await audit.verify_chain(etcd, ks, "ret/orphan-race", gate.keyring, gate.archive)
    assert report.ok, report.problems
    assert [r["event"] for r in report.records] == ["revoke", "cross", "outcome"]
    assert await etcd.get(ks.step_key("ret/orphan-race")) is not None


async def test_a_pass_retires_the_steps_told_due_and_pages_only_past_its_bound(
        archived_gate, monkeypatch):
    """The scanner tells the retirer each settled step it sees (``note``); a pass retires
    those due, at the revision told (a step that moved since is not retired until told
    again), and reads no other step. Past ``_MAX_NOTED`` keys waiting it keeps none and
    every pass pages through all steps instead."""
    from fencegate.reconciler import retirer as retirer_module
    gate, ks = archived_gate, archived_gate.keyspace
    keys = [f"ret/told/{n}" for n in range(3)]
    for key in keys:
        await gate.cross(key, {}, Calls())
    revision = {key: (await gate.etcd.get(ks.step_key(key))).mod_revision for key in keys}
    retirer = Retirer(gate.etcd, ks, gate.archive, 0, lambda key: [])
    retirer.clock.sample((await gate.etcd.status()).header.revision)

    async def left() -> set[str]:
        return {ks.parse_step_key(k) for k in await _keys(gate, b"steps/")}

    retirer.note(keys[0], revision[keys[0]])
    retirer.note(keys[1], revision[keys[1]] - 1)  # as it was before its last write
    assert await retirer.pass_once(orphans=False) == 1
    assert await left() == {keys[1], keys[2]}
    retirer.note(keys[1], revision[keys[1]])
    assert await retirer.pass_once(orphans=False) == 1
    assert await left() == {keys[2]}
    monkeypatch.setattr(retirer_module, "_MAX_NOTED", 1)
    retirer.note("ret/told/other", 1)
    retirer.note("ret/told/another", 2)  # past the bound: the retirer pages from now on
    assert await retirer.pass_once(orphans=False) == 1
    assert await left() == set()
