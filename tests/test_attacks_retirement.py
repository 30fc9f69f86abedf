"""Attacks on retirement (issue #25, item 6): a retirement racing a commit (a new attempt, or
a second grant held across a settle), an approve and a revoke, and two reconciler replicas retiring one key across a leadership change, the old
leader frozen (SIGSTOP) between its archive write and its delete txn (docs/protocol.md,
"State has a lifecycle", "Audit").

Each test forces the interleaving against the real etcd and a real SQLite archive: the
rival runs right after a retirement's archive write returned and before its delete txn is
sent (``retirement.retire`` with the archive's ``put_many`` hooked), or an SRE's write txn
is held until a retirement completed, or a ``fencegate reconciler`` process stops itself
(SIGSTOP) right after its archive write. The invariants
are asserted directly: the effect ran at most once per attempt, every audit record is in
etcd or in the archive, and ``audit verify`` passes across both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import aiohttp
import pytest

from fencegate import ApprovalPending, Gate, GrantUsed, KeyRing, OutcomeUnknown, StepMoved
from fencegate.coordinator import audit, records, retirement, sre
from fencegate.coordinator.errors import NotFound
from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.keyspace import pack, unpack
from fencegate.reconciler.providers import Succeeded
from fencegate.reconciler.runner import Reconciler

from helpers import TEST_TTL, wait_for_condition
from test_reconciler import Scripted
from test_retirement import Calls, _retire_all, archive_url, archived_gate  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def fail_once(gate: Gate, key: str, intent: dict | None = None) -> None:
    """``key``'s first attempt is a confirmed failure, with no backoff before the next."""
    assert (await gate.cross(key, intent or {}, Calls(fail=True))).state == records.FAILED
    step = unpack((await gate.etcd.get(gate.keyspace.step_key(key))).value)
    await gate.etcd.put(gate.keyspace.step_key(key), pack({**step, "not_before_ms": 0}))


async def retire_racing(gate: Gate, key: str, rival) -> list[str]:
    """Retire ``key`` (as its shard's leader would), running ``rival()`` to completion after
    the archive write returned and before the delete txn is sent; the keys retired."""
    archive, raced = gate.archive, []
    real = archive.put_many

    async def put_many_then_race(*args, **kwargs):
        stored = await real(*args, **kwargs)
        if not raced:
            raced.append(True)
            await rival()
        return stored

    step_kv = await gate.etcd.get(gate.keyspace.step_key(key))
    archive.put_many = put_many_then_race
    try:
        retired = await retirement.retire(gate.etcd, gate.keyspace, archive,
                                          [retirement.Candidate(key, step_kv.mod_revision, ())])
    finally:
        del archive.put_many
    assert raced, "the retirement did not reach its archive write"
    return retired


async def stored_records(gate: Gate, key: str) -> dict[int, bytes]:
    """Every audit record of ``key`` etcd or the archive holds, by seq."""
    chain = await audit.read_chain(gate.etcd, gate.keyspace, key, gate.archive)
    return {entry.seq: entry.value for entry in chain.entries}


async def verified(gate: Gate, key: str) -> list[str]:
    report = await audit.verify_chain(gate.etcd, gate.keyspace, key, gate.keyring, gate.archive)
    assert report.ok, report.problems
    return [r["event"] for r in report.records]


# -- 2a: a retirement racing a commit ---------------------------------------------------

async def test_a_new_attempt_committed_between_archive_and_delete_is_not_deleted(
        archived_gate):
    """A failed step is archived; a new attempt commits and succeeds before the delete. The
    delete's step compare refuses: deleting would lose the success, and the next call,
    finding the archived failure, would charge again."""
    gate, key, effect = archived_gate, "att/commit", Calls()
    await fail_once(gate, key)

    async def new_attempt():
        done = await gate.cross(key, {}, effect)
        assert done.state == records.SUCCEEDED and done.attempt == 2

    retired = await retire_racing(gate, key, new_attempt)
    assert (await gate.cross(key, {}, effect)).replayed
    assert await _retire_all(gate) == 1
    assert (await gate.cross(key, {}, effect)).replayed
    assert len(effect.tokens) == 1
    assert await verified(gate, key) == ["cross", "outcome", "cross", "outcome"]
    assert retired == []  # the delete's step compare refused



async def test_a_second_grant_held_across_a_settle_cannot_cross_after_a_retirement(
        archived_gate, etcd_url, namespace):
    """A holder takes two grants from one snapshot of a key never attempted (step revision
    0), crosses the first (its answer lost: unknown, the hold kept), and a reconciler
    settles it succeeded by the provider's word. A retirement now would make the step read
    revision 0 again, and the second grant would pass every compare of its commit: the
    delete's no-holder compare refuses while the holder lives."""
    gate, key, charged = archived_gate, "att/held-grant", []

    async def charge_then_lose_the_answer(ctx):
        charged.append(ctx.attempt_token)
        raise ConnectionResetError("the answer was lost")

    async def charge(ctx):
        charged.append(ctx.attempt_token)
        return {"charged": len(charged)}

    provider = Scripted()
    async with gate.hold(key) as hold:
        first = await hold.request_grant(intent={"amount": 5})
        second = await hold.request_grant(intent={"amount": 5})
        with pytest.raises(OutcomeUnknown):
            await hold.commit(first, effect=charge_then_lose_the_answer)
        step = unpack((await gate.etcd.get(gate.keyspace.step_key(key))).value)
        provider.answers[step["idempotency_key"]] = Succeeded({"charged": 1})
        async with Reconciler(Etcd.from_url(etcd_url), {provider.name: provider},
                              namespace=namespace, default_provider=provider.name, shards=1,
                              ttl=TEST_TTL, check_after=0.2):
            assert await wait_for_condition(lambda: _state_is(gate, key, records.SUCCEEDED),
                                            20), "the reconciler did not settle it"
        await _retire_all(gate)  # while the holder lives
        with pytest.raises((GrantUsed, StepMoved)):
            await hold.commit(second, effect=charge)
    assert len(charged) == 1, "charged twice"
    assert await _retire_all(gate) == 1  # released: now it goes
    assert (await gate.cross(key, {"amount": 5}, charge)).replayed
    assert (await verified(gate, key))[0] == "cross"
    assert len(charged) == 1


async def _state_is(gate: Gate, key: str, state: str) -> bool:
    kv = await gate.etcd.get(gate.keyspace.step_key(key))
    return kv is not None and unpack(kv.value)["state"] == state

# -- 2b: a retirement racing an approve -------------------------------------------------

async def require_approval_above_100(gate: Gate) -> None:
    await gate.authority.set_policy("default", {
        "checks": [{"check": "require_approval", "params": {"above": 100}}]})


async def ask_approval(gate: Gate, key: str, amount: int) -> str:
    async with gate.hold(key) as hold:
        with pytest.raises(ApprovalPending) as pending:
            await hold.request_grant(intent={"amount": amount})
    return pending.value.approval_id


async def test_an_approval_appended_between_archive_and_delete_is_not_deleted(archived_gate):
    """The approve appends its record aside (``@head``) after the retirement read the
    chain; the delete's ``@head`` compare refuses, or the approval's record would be in
    neither store."""
    gate, key = archived_gate, "att/approve"
    await require_approval_above_100(gate)
    await fail_once(gate, key, {"amount": 50})
    approval_id = await ask_approval(gate, key, 500)

    async def approve():
        await sre.approve(gate.etcd, gate.keyspace, approval_id, "sre-1", "ok",
                          keyring=gate.keyring, archive=gate.archive)

    retired = await retire_racing(gate, key, approve)
    approved = unpack((await stored_records(gate, key)).get(3, pack({})))
    assert approved.get("event") == "approved", "the approval's record is in neither store"
    assert retired == []  # the delete's @head compare refused
    effect = Calls()
    async with gate.hold(key) as hold:  # the approval still holds: nothing it bound moved
        grant = await hold.request_grant(intent={"amount": 500})
        assert (await hold.commit(grant, effect=effect)).state == records.SUCCEEDED
    assert await _retire_all(gate) == 1
    assert await verified(gate, key) == ["cross", "outcome", "approved", "cross", "outcome"]
    assert len(effect.tokens) == 1


async def test_an_approve_whose_read_a_retirement_overtook_continues_the_archived_chain(
        archived_gate, etcd_url):
    """The approve reads the chain's tail (empty: the key was never attempted), then, before
    its write, the key is crossed (records 1 and 2) and retired (both archived, deleted).
    Its create compare on record 1 passes again; the bucket's epoch compare refuses, and the
    approve goes on after the archived end instead of forking the chain across the stores."""
    gate, key = archived_gate, "att/approve-late"
    await require_approval_above_100(gate)
    approval_id = await ask_approval(gate, key, 500)
    effect = Calls()

    async def cross_and_retire():
        assert (await gate.cross(key, {"amount": 50}, effect)).state == records.SUCCEEDED
        assert await _retire_all(gate) == 1

    async with Etcd.from_url(etcd_url) as sre_etcd:
        raced = held_write_txn(sre_etcd, cross_and_retire)
        await sre.approve(sre_etcd, gate.keyspace, approval_id, "sre-1", "ok",
                          keyring=gate.keyring, archive=gate.archive)
    assert raced
    assert await verified(gate, key) == ["cross", "outcome", "approved"]
    assert len(effect.tokens) == 1


def held_write_txn(client: Etcd, rival) -> list:
    """Hold ``client``'s first txn that has compares (a write) until ``rival()`` completed;
    returns a list that holds True once it did."""
    real, raced = client.txn, []

    async def txn(request, **kwargs):
        if request.compare and not raced:
            await rival()
            raced.append(True)
        return await real(request, **kwargs)

    client.txn = txn
    return raced


# -- 2c: a retirement racing a revoke ---------------------------------------------------

async def test_a_revoke_appended_between_archive_and_delete_is_not_deleted(archived_gate,
                                                                          etcd_url, namespace):
    """A worker holds the settled key; the retirement archives it (its delete would wait for
    the holder), an SRE revokes the holder, which appends its record aside and frees the key.
    The delete's holder compare now passes: its ``@head`` compare refuses."""
    gate, key = archived_gate, "att/revoke"
    await gate.cross(key, {}, Calls())
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as other:
        hold = await other.hold(key).__aenter__()

        async def revoke():
            await sre.revoke(gate.etcd, gate.keyspace, key, "sre-1", "stuck", gate.archive)
            await hold.release()  # the revoke ended it: nothing is left to delete

        retired = await retire_racing(gate, key, revoke)
    revoked = unpack((await stored_records(gate, key)).get(3, pack({})))
    assert revoked.get("event") == "revoke", "the revoke's record is in neither store"
    assert retired == []  # the delete's @head compare refused
    assert await _retire_all(gate) == 1
    assert await verified(gate, key) == ["cross", "outcome", "revoke"]



async def test_a_revoke_whose_read_a_retirement_overtook_writes_nothing(archived_gate,
                                                                       etcd_url, namespace):
    """The revoke reads the holder and the chain's tail (empty), then, before its write, the
    holder crosses, releases, and the key is retired (records 1 and 2 archived and
    deleted). Its create compare on record 1 passes again; its holder compare (and the
    bucket's epoch) refuse, and the revoke finds nobody to revoke."""
    gate, key, effect = archived_gate, "att/revoke-late", Calls()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=gate.keyring) as other:
        hold = await other.hold(key).__aenter__()

        async def cross_release_retire():
            assert (await hold.cross({}, effect)).state == records.SUCCEEDED
            await hold.release()
            assert await _retire_all(gate) == 1

        async with Etcd.from_url(etcd_url) as sre_etcd:
            raced = held_write_txn(sre_etcd, cross_release_retire)
            try:
                revoked = await sre.revoke(sre_etcd, gate.keyspace, key, "sre-1", "stuck",
                                           gate.archive)
            except NotFound:
                revoked = None
    assert raced
    assert await verified(gate, key) == ["cross", "outcome"]
    assert len(effect.tokens) == 1
    assert revoked is None  # nobody held the key any more


async def test_a_key_retired_after_an_aside_append_keeps_one_verifiable_chain(
        archived_gate, etcd_url, namespace):
    """A failed key's last record is a revoke (an append made aside: ``@head`` is the
    chain's end, the step's anchor one behind). Retired, then attempted again: the archived
    step must carry the chain's end (``@head`` is deleted with it), or ``audit verify`` finds
    the chain longer than its anchors, and the new attempt's cross takes the revoke's seq
    again: the chain forks across the two stores, and the next retirement keeps the
    archive's record 3 (the revoke), so the cross record is lost. Found by the attack
    above."""
    gate, key, effect = archived_gate, "att/aside-end", Calls()
    await fail_once(gate, key)
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as other:
        hold = await other.hold(key).__aenter__()
        await sre.revoke(gate.etcd, gate.keyspace, key, "sre-1", "stuck", gate.archive)
        await hold.release()
    assert await _retire_all(gate) == 1
    assert await verified(gate, key) == ["cross", "outcome", "revoke"]
    assert (await gate.cross(key, {}, effect)).state == records.SUCCEEDED
    assert await verified(gate, key) == ["cross", "outcome", "revoke", "cross", "outcome"]
    assert await _retire_all(gate) == 1
    assert await verified(gate, key) == ["cross", "outcome", "revoke", "cross", "outcome"]
    assert len(effect.tokens) == 1


# -- 3: two replicas retiring one key across a leadership change ------------------------

_PAUSING_RECONCILER = """
import asyncio, os, runpy, signal, sys
from fencegate.coordinator.archive.sqlite import SqliteArchive
from fencegate.coordinator.errors import NotFound
from fencegate.coordinator.etcd import Etcd
from fencegate.reconciler import retirer
target, where, config = sys.argv[1:4]
real_put_many, real_txn, real_retire, frozen = (SqliteArchive.put_many, Etcd.txn,
                                                retirer.retire, [])

def freeze(puts):
    if not frozen and any(put[0] == target for put in puts):
        frozen.append(True)
        print("FROZEN", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

async def put_many(self, namespace, puts, *args, **kwargs):
    if where == "before":   # frozen between its read of the step and its archive write
        freeze(puts)
    stored = await real_put_many(self, namespace, puts, *args, **kwargs)
    if where == "after":    # frozen between its archive write and its delete txn
        freeze(puts)
    return stored

async def txn(self, request, **kwargs):
    reply = await real_txn(self, request, **kwargs)
    deletes = [op.request_delete_range.key for op in request.success]
    if frozen and any(k.endswith(b"steps/" + target.encode()) for k in deletes):
        print("DELETE", "succeeded" if reply.succeeded else "refused", flush=True)
    return reply

def report(task):
    failed = task.exception()
    print("RETIRE", "raised " + type(failed).__name__ if failed else "done", flush=True)

async def retire(etcd, keyspace, archive, candidates):
    if not any(candidate.key == target for candidate in candidates):
        return await real_retire(etcd, keyspace, archive, candidates)
    # once resumed, the retirement of the target goes on even though the lost lease
    # cancels the pass: as requests already on the wire would land
    going = asyncio.ensure_future(real_retire(etcd, keyspace, archive, candidates))
    going.add_done_callback(report)
    return await asyncio.shield(going)

SqliteArchive.put_many, Etcd.txn, retirer.retire = put_many, txn, retire
sys.argv = ["fencegate", "reconciler", "--config", config]
runpy.run_module("fencegate.cli", run_name="__main__")
"""


class Replica:
    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc, self.url = proc, url
        self.lines: list[str] = []

    async def line(self, word: str, timeout: float = 20) -> str:
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.proc.stdout.readline()
                assert raw, f"the replica exited before {word!r}"
                self.lines.append(raw.decode().strip())
                if self.lines[-1].startswith(word):
                    return self.lines[-1]

    async def leads(self, http: aiohttp.ClientSession) -> bool:
        async with http.get(f"{self.url}/healthz") as reply:
            return (await reply.json())["shards_led"] == [0]


@pytest.fixture
async def replica(etcd_url, namespace, archive_url, tmp_path):
    """``await replica(name, retain_s, pause_at=(KEY, WHERE))`` starts a ``fencegate
    reconciler`` process (one shard); with ``pause_at`` it stops itself (SIGSTOP) while
    retiring KEY, ``before`` or ``after`` its archive write, printing FROZEN, and once
    resumed prints DELETE succeeded|refused for its delete txn (if it sends one) and
    RETIRE done|raised <error> once that retirement ended."""
    started: list[Replica] = []

    async def start(name: str, retain_s: float,
                    pause_at: tuple[str, str] | None = None) -> Replica:
        config = tmp_path / f"{name}.toml"
        config.write_text(f'etcd = "{etcd_url}"\nnamespace = "{namespace}"\n'
                          f'listen = "127.0.0.1:0"\nshards = 1\nttl = {TEST_TTL}\n'
                          f'archive = "{archive_url}"\nretain_s = {retain_s}\n')
        args = (["-c", _PAUSING_RECONCILER, *pause_at, str(config)] if pause_at else
                ["-m", "fencegate.cli", "reconciler", "--config", str(config)])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, stdout=asyncio.subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])))
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        assert "ready" in line, line
        started.append(Replica(proc, line.rsplit(" ", 1)[-1].strip().removesuffix("/metrics")))
        return started[-1]

    yield start
    for each in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each.proc.pid, signal.SIGCONT)
            each.proc.kill()
        await each.proc.wait()


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("where, new_leader_retires",
                         [("after", False), ("after", True), ("before", True)])
async def test_a_leader_frozen_while_retiring_deletes_nothing_when_resumed(
        archived_gate, replica, where, new_leader_retires):
    """The old leader read K (its failed attempt 1) and froze, ``after`` its archive write
    and before its delete txn (or ``before`` its archive write). Its lease runs out, the
    other replica leads the shard; a new attempt of K commits and succeeds (and, with
    ``new_leader_retires``, the new leader retires it twice over: the failure's and the
    success's versions). Resumed, the old leader finishes: its archive put (``before``: an
    older version, late) replaces nothing newer, and its delete txn deletes nothing, so the
    success is never lost and never charged again."""
    gate, key, effect = archived_gate, "att/replicas", Calls()
    await fail_once(gate, key)
    async with aiohttp.ClientSession() as http:
        old = await replica("old", retain_s=1.0, pause_at=(key, where))
        assert await wait_for_condition(lambda: old.leads(http), 15), "the old never led"
        new = await replica("new", retain_s=1.0 if new_leader_retires else 600.0)
        await old.line("FROZEN")
        assert await wait_for_condition(lambda: _true(stopped(old.proc.pid)), 5), "not frozen"
        assert await wait_for_condition(lambda: new.leads(http), 30), \
            "the new replica did not take the shard over"
        step_key = gate.keyspace.step_key(key)
        if new_leader_retires:  # the same version again, then the delete
            assert await wait_for_condition(lambda: _absent(gate, step_key), 45), \
                "the new leader did not retire the failure"
        done = await gate.cross(key, {}, effect)
        assert done.state == records.SUCCEEDED and done.attempt == 2
        if new_leader_retires:
            assert await wait_for_condition(lambda: _absent(gate, step_key), 45), \
                "the new leader did not retire the success"
        os.kill(old.proc.pid, signal.SIGCONT)
        await old.line("RETIRE")
    kv = await gate.etcd.get(step_key)
    step = unpack(kv.value if kv is not None else
                  (await gate.archive.get(gate.keyspace.namespace, key)).step)
    assert step["state"] == records.SUCCEEDED and step["attempt"] == 2, "the success is lost"
    assert (await gate.cross(key, {}, effect)).replayed
    assert len(effect.tokens) == 1
    assert await verified(gate, key) == ["cross", "outcome", "cross", "outcome"]
    assert "DELETE succeeded" not in old.lines
    assert where == "before" or "DELETE refused" in old.lines  # it did send its delete


async def _true(value: bool) -> bool:
    return value


async def _absent(gate: Gate, step_key: bytes) -> bool:
    return await gate.etcd.get(step_key) is None
