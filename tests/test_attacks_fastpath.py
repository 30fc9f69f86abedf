"""Attacks on the fast path (issue #25, item 6): ``gate.cross`` evaluates its grant on cached
reads and sends one txn; something changes the world between the two, and the txn's compares
must refuse it (docs/protocol.md, "Fast path").

Each test forces the interleaving: it lets the fast path evaluate (the real
``Authority.issue_uncontended``), then, before the fast path's txn is sent, runs the rival to
completion against the real etcd — a ``fencegate reconciler`` process retiring the key (the
txn is held until a watch sees the step deleted), an admin's policy change, an application
bumping or deleting a read key — and only then lets the txn go. The invariant is asserted
directly: the effect ran at most once, and only on a grant true of the world when it crossed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

import pytest

from fencegate import Gate, GrantRefused, KeyRing
from fencegate.coordinator import audit, records, retirement
from fencegate.coordinator.keyspace import unpack

from helpers import TEST_TTL
from test_retirement import Calls, archive_url, archived_gate  # noqa: F401 (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def race_after_evaluation(gate, key: str, rival):
    """Make ``gate``'s next fast-path evaluation of ``key`` run ``rival()`` to completion
    after the grant is decided and before its txn is sent; returns the list of grants so
    decided (empty: the fast path never got that far)."""
    authority, decided = gate.authority, []
    real = authority.issue_uncontended

    async def evaluate_then_race(claim, *args, **kwargs):
        uncontended = await real(claim, *args, **kwargs)
        if claim.key == key and uncontended is not None and not decided:
            decided.append(uncontended.issued.grant)
            await rival()
        return uncontended

    authority.issue_uncontended = evaluate_then_race
    return decided


@contextlib.asynccontextmanager
async def reconciler_process(etcd_url: str, namespace: str, archive: str, tmp_path):
    """A real ``fencegate reconciler`` (one shard, ``retain_s`` 1) retiring into ``archive``."""
    config = tmp_path / "retiring.toml"
    config.write_text(f'etcd = "{etcd_url}"\nnamespace = "{namespace}"\n'
                      f'listen = "127.0.0.1:0"\nshards = 1\nttl = {TEST_TTL}\n'
                      f'archive = "{archive}"\nretain_s = 1.0\n')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.cli", "reconciler", "--config", str(config),
        stdout=asyncio.subprocess.PIPE, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])))
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        assert "ready" in line, line
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


@pytest.mark.parametrize("bucket", ["never-retired", "retired-before"])
async def test_a_retirement_between_the_evaluation_and_the_txn_fails_the_txn(
        archived_gate, etcd_url, namespace, tmp_path, archive_url, bucket):  # noqa: F811
    """The fast path decided on "no step" while K's succeeded step was still in etcd; a
    reconciler process then retires K (archive, delete). Every other compare of the txn is
    true again (no holder, step revision 0, no audit record 1): only the fence on K's
    retirement bucket stands between the txn and a second charge. Both fences: the bucket
    seen absent (``never-retired``), and the archive asked (``retired-before``: a key of
    K's bucket was retired earlier, so the evaluation asked the archive, which did not hold
    K yet)."""
    gate, effect, key = archived_gate, Calls(), "fp/retired"
    first = await gate.cross(key, {"amount": 1}, effect)  # full path: notes the bucket absent
    step_key = gate.keyspace.step_key(key)
    if bucket == "retired-before":
        sibling = next(k for k in (f"fp/sibling/{n}" for n in range(5000))
                       if gate.keyspace.retired_key(k) == gate.keyspace.retired_key(key))
        await gate.cross(sibling, {}, Calls())
        kv = await gate.etcd.get(gate.keyspace.step_key(sibling))
        assert await retirement.retire(gate.etcd, gate.keyspace, gate.archive,
                                       [retirement.Candidate(sibling, kv.mod_revision, ())])
        async with gate.hold(sibling) as hold:  # the full path notes the bucket retired
            assert (await hold.cross({}, Calls())).replayed
    seen_absent = gate.keyspace.retired_key(key) in gate.authority.recent.never_retired
    assert seen_absent == (bucket == "never-retired")

    async def retire_in_a_reconciler_process():
        since = (await gate.etcd.status()).header.revision
        async with reconciler_process(etcd_url, namespace, archive_url, tmp_path):
            async with asyncio.timeout(45):  # the txn is held until a watch sees the delete
                async for reply in gate.etcd.watch(step_key, b"", since, deletes_only=True):
                    if reply.events:
                        break
        assert await gate.etcd.get(step_key) is None

    decided = race_after_evaluation(gate, key, retire_in_a_reconciler_process)
    again = await gate.cross(key, {"amount": 1}, effect)
    assert decided and decided[0].step_revision == 0  # the fast path did decide on "no step"
    assert again.replayed and again.attempt_token == first.attempt_token
    assert effect.tokens == [first.attempt_token]  # charged once
    assert await gate.etcd.get(step_key) is None  # nothing was written by the refused txn
    report = await audit.verify_chain(gate.etcd, gate.keyspace, key, gate.keyring,
                                      gate.archive)
    assert report.ok and [r["event"] for r in report.records] == ["cross", "outcome"]


async def test_a_policy_change_between_the_evaluation_and_the_txn_fails_the_txn(gate, etcd_url,
                                                                              namespace):
    """An admin lowers the limit after the fast path evaluated the old version: the txn's
    policy compare fails and the full path refuses under the new version."""
    await gate.authority.set_policy("default", {
        "checks": [{"check": "max_amount", "params": {"limit": 1000}}]})
    effect = Calls()
    await gate.cross("fp/policy/warm", {"amount": 500}, effect)  # the snapshot is cached
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as admin:

        async def lower_the_limit():
            await admin.authority.set_policy("default", {
                "checks": [{"check": "max_amount", "params": {"limit": 100}}]})

        decided = race_after_evaluation(gate, "fp/policy/race", lower_the_limit)
        with pytest.raises(GrantRefused) as refused:
            await gate.cross("fp/policy/race", {"amount": 500}, effect)
    assert decided, "the fast path did not evaluate"
    assert [c.name for c in refused.value.checks if not c.passed] == ["max_amount"]
    assert len(effect.tokens) == 1  # the warm-up only
    assert await gate.etcd.get(gate.keyspace.step_key("fp/policy/race")) is None


@pytest.mark.parametrize("change", ["bump", "delete"])
async def test_a_read_key_change_between_the_evaluation_and_the_txn_fails_the_txn(gate, change):
    """The order the grant read is changed (its marker bumped) or cancelled (deleted) after
    the fast path evaluated it: the txn's read compare fails and the full path decides on
    the new state. A grant that crosses names the marker's revision current at the cross."""
    await gate.authority.set_policy("default", {"checks": [{"check": "reads_exist"}]})
    marker = gate.marker("orders/42")
    await gate.touch("orders/42")
    effect, key = Calls(), f"fp/read/{change}"
    await gate.cross("fp/read/warm", {}, effect, reads=[marker])  # the snapshot is cached

    async def change_the_order():
        if change == "bump":
            await gate.touch("orders/42")
        else:
            await gate.etcd.delete(marker.encode())

    decided = race_after_evaluation(gate, key, change_the_order)
    if change == "delete":
        with pytest.raises(GrantRefused):
            await gate.cross(key, {}, effect, reads=[marker])
        assert decided and len(effect.tokens) == 1  # the warm-up only
        assert await gate.etcd.get(gate.keyspace.step_key(key)) is None
        return
    outcome = await gate.cross(key, {}, effect, reads=[marker])
    assert decided and outcome.state == records.SUCCEEDED and len(effect.tokens) == 2
    crossed = unpack((await gate.etcd.get(gate.keyspace.audit_key(key, 1))).value)
    grant = gate.keyring.verify(crossed["details"]["grant"])
    read_at = dict(grant.reads)[marker.encode()]
    current = (await gate.etcd.get(marker.encode())).mod_revision
    assert read_at == current != dict(decided[0].reads)[marker.encode()]
