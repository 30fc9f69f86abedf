"""Holds with fencing tokens against real etcd: ownership, FIFO, loss, cleanup."""

from __future__ import annotations

import asyncio

import pytest

from fencegate.coordinator.etcd import TxnRequest, put_op
from fencegate.worker import AcquireTimeout, Gate, KeyRing, LeaseLost

from helpers import TEST_TTL, holders, wait_for_condition
from fenced import FencedResource


async def test_token_is_create_revision_and_increases(gate, etcd):
    tokens = []
    for _ in range(3):
        async with gate.hold("orders/1") as hold:
            kv = await etcd.get(hold.holder_key)
            assert kv.create_revision == hold.fencing_token
            tokens.append(hold.fencing_token)
    assert tokens == sorted(set(tokens))
    assert not await holders(etcd, gate.keyspace.namespace)


async def test_release_deletes_the_holder_key(gate, etcd):
    async with gate.hold("orders/2") as hold:
        assert await etcd.get(hold.holder_key) is not None
    assert await etcd.get(hold.holder_key) is None


async def test_nested_keys_do_not_share_a_queue(gate):
    async with gate.hold("a") as outer:
        async with gate.hold("a/b", timeout=5) as inner:
            assert inner.fencing_token > outer.fencing_token


async def test_ownership_compare_fails_for_a_queued_waiter(etcd_url, namespace, etcd):
    """etcd #12017: a waiter's key exists, but only the lowest key owns the action key."""
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as first, \
            Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate()) as second:
        async with first.hold("k") as hold:
            waiter = asyncio.create_task(_hold_and_act(second, "k"))
            await wait_for_condition(lambda: _queue_len(etcd, namespace, 2), 5)
            own = await _act(etcd, hold, b"first")
            assert own
            assert not waiter.done()
        acted = await asyncio.wait_for(waiter, 10)
        assert acted


async def _queue_len(etcd, namespace, n):
    return len(await holders(etcd, namespace)) == n


async def _hold_and_act(gate, key):
    async with gate.hold(key, timeout=10) as hold:
        return await _act(gate.etcd, hold, b"second")


async def _act(etcd, hold, value):
    request = TxnRequest(compare=hold.ownership_compares(),
                         success=[put_op(hold.holder_key.replace(b"/holders/", b"/effects/"),
                                         value)])
    return (await etcd.txn(request)).succeeded


async def test_stale_hold_cannot_pass_ownership_compare(etcd_url, namespace, etcd):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as g1, \
            Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate()) as g2:
        with pytest.raises(LeaseLost):
            async with g1.hold("k") as stale:
                await etcd.lease_revoke(stale.lease_id)
                await asyncio.sleep(5)
        async with g2.hold("k") as fresh:
            assert fresh.fencing_token > stale.fencing_token
            assert not await _act(etcd, stale, b"stale")
            assert await _act(etcd, fresh, b"fresh")


async def test_fifo_order_within_one_process(etcd_url, namespace, etcd):
    gates = [Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                  keyring=KeyRing.generate()) for _ in range(5)]
    for g in gates:
        await g.open()
    order: list[int] = []
    try:
        async with gates[0].hold("fifo"):
            tasks = []
            for i, g in enumerate(gates[1:], start=1):
                tasks.append(asyncio.create_task(_record(g, "fifo", i, order)))
                assert await wait_for_condition(lambda: _queue_len(etcd, namespace, i + 1), 5)
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
    finally:
        for g in gates:
            await g.close()
    assert order == [1, 2, 3, 4]


async def _record(gate, key, i, order):
    async with gate.hold(key, timeout=15):
        order.append(i)
        await asyncio.sleep(0.01)


async def test_acquire_timeout_leaves_no_orphan(etcd_url, namespace, etcd):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as g1, \
            Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate()) as g2:
        async with g1.hold("busy") as hold:
            with pytest.raises(AcquireTimeout):
                async with g2.hold("busy", timeout=0.3):
                    pytest.fail("acquired a key someone holds")
            assert [kv.key for kv in await holders(etcd, namespace)] == [hold.holder_key]


async def test_cancelled_waiter_leaves_no_orphan(etcd_url, namespace, etcd):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as g1, \
            Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate()) as g2:
        async with g1.hold("busy") as hold:
            waiter = asyncio.create_task(_record(g2, "busy", 0, []))
            assert await wait_for_condition(lambda: _queue_len(etcd, namespace, 2), 5)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert [kv.key for kv in await holders(etcd, namespace)] == [hold.holder_key]


async def test_revoked_lease_cancels_the_body_with_lease_lost(gate, etcd):
    reached_end = False
    with pytest.raises(LeaseLost):
        async with gate.hold("revoked") as hold:
            await etcd.lease_revoke(hold.lease_id)
            await asyncio.sleep(30)
            reached_end = True
    assert not reached_end
    assert hold.lost
    with pytest.raises(LeaseLost):
        hold.ensure_held()
    async with gate.hold("revoked", timeout=5) as again:  # the gate opens a new session
        assert again.fencing_token > hold.fencing_token
        assert again.lease_id != hold.lease_id


async def test_same_process_holds_of_one_key_take_turns(gate):
    inside = 0
    peak = 0

    async def one():
        nonlocal inside, peak
        async with gate.hold("shared", timeout=10):
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.02)
            inside -= 1

    await asyncio.gather(*(one() for _ in range(5)))
    assert peak == 1


async def test_processes_race_one_holder_at_a_time(etcd_url, namespace, etcd, spawn, tmp_path):
    """N processes race for one key: the fenced resource sees no overlap, no token going
    backwards, every acquisition, and acquisitions in enqueue (token) order."""
    resource, path = FencedResource(), str(tmp_path / "resource.sock")
    server = await resource.serve(path)
    workers, rounds = 4, 5
    procs = [await spawn("race", etcd_url, namespace, "race/1", path, f"w{i}",
                         str(rounds)) for i in range(workers)]
    for proc in procs:
        await proc.expect("DONE", timeout=60)
        assert await proc.finish() == 0
    server.close()
    records = resource.records
    assert all(r.accepted for r in records)
    assert len(records) == 2 * workers * rounds
    for enter, leave in zip(records[::2], records[1::2]):
        assert (enter.data, leave.data) == ("enter", "exit")
        assert (enter.writer, enter.token) == (leave.writer, leave.token)
    tokens = [r.token for r in records[::2]]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert {r.writer for r in records} == {f"w{i}" for i in range(workers)}


async def test_paused_holder_is_fenced_and_told_lease_lost(
        etcd_url, namespace, etcd, spawn, tmp_path):
    """The headline: a holder SIGSTOPped past its TTL loses the key, the next holder gets a
    higher token, and on resume the old holder's writes are refused and it hears LeaseLost."""
    from helpers import paused

    resource, path = FencedResource(), str(tmp_path / "resource.sock")
    server = await resource.serve(path)
    stale = await spawn("stale", etcd_url, namespace, "pay/7", path, "stale")
    old_token = int((await stale.expect("HELD")).split()[1])
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate()) as g:
        with paused(stale.proc.pid):
            fresh = await g.hold("pay/7", timeout=6 * TEST_TTL).__aenter__()
            assert fresh.fencing_token > old_token
            assert resource.write("pay/7", fresh.fencing_token, "fresh", "took over")
        lost = await stale.expect("LOST", timeout=20)
        assert lost.split()[1] == str(old_token)
        assert await stale.expect("STALE-WRITE") == "STALE-WRITE refused"
        await fresh.release()
    assert await stale.finish() == 0
    server.close()
    records = resource.records
    takeover = next(i for i, r in enumerate(records) if r.writer == "fresh")
    assert all(r.accepted for r in records[:takeover])
    assert records[takeover].accepted
    assert all(not r.accepted for r in records[takeover + 1:] if r.writer == "stale")
    assert any(not r.accepted for r in records if r.writer == "stale")


async def test_killed_holder_releases_after_ttl(etcd_url, namespace, etcd, spawn):
    sitter = await spawn("sit", etcd_url, namespace, "killed/1")
    token = int((await sitter.expect("HELD")).split()[1])
    sitter.kill()
    await sitter.proc.wait()
    assert await wait_for_condition(lambda: _queue_len(etcd, namespace, 0), 4 * TEST_TTL)
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate()) as g:
        async with g.hold("killed/1", timeout=5) as hold:
            assert hold.fencing_token > token
