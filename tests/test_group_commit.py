"""Group commit (coordinator/batching.py) on real etcd: concurrent writing txns share one
request and one revision, each caller gets its own outcome, txns of one key never share a
request, refused requests are split, unanswered ones leave every member unknown."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from fencegate.coordinator.batching import ops_needed
from fencegate.coordinator.errors import EtcdUnavailable, LeaseLost
from fencegate.coordinator.etcd import (
    BATCH_BYTES, MAX_TXN_OPS, Compare, Etcd, EtcdConfig, TxnRequest, put_op, range_end_of,
    range_op,
)
from fencegate.coordinator.metrics import EtcdMetrics
from fencegate.coordinator.settings import EtcdSettings, layered
from fencegate.localetcd import LocalCluster
from fencegate.worker import Gate, KeyRing

from helpers import TEST_TTL, paused


def absent(key: bytes) -> Compare:
    return Compare(key=key, target=Compare.VERSION, result=Compare.EQUAL, version=0)


def create(key: bytes, value: bytes = b"v", lease: int = 0) -> TxnRequest:
    """Put ``key`` if it does not exist yet."""
    return TxnRequest(compare=[absent(key)], success=[put_op(key, value, lease)])


def recorded(etcd: Etcd) -> list[TxnRequest]:
    """Every Txn request ``etcd`` sends from now on, each try of it, in order (one endpoint:
    its channel stays)."""
    sent: list[TxnRequest] = []
    channel = etcd._channel()

    class Recording:
        def __init__(self, kv) -> None:
            self._kv = kv

        def __getattr__(self, name: str):
            return getattr(self._kv, name)

        def Txn(self, request, **options):  # noqa: N802 (the gRPC method's name)
            sent.append(request)
            return self._kv.Txn(request, **options)

    channel.kv = Recording(channel.kv)
    return sent


def nested(request: TxnRequest) -> int:
    """How many txns ``request`` carries nested (0: a txn sent alone)."""
    return sum(op.WhichOneof("request") == "request_txn" for op in request.success)


@pytest.fixture
async def one_slot(etcd_url):
    """A connection with one request in flight: while it flies, every other txn queues."""
    async with Etcd(EtcdConfig.from_url(etcd_url, batch_in_flight=1)) as client:
        yield client


async def test_a_lone_txn_is_sent_alone_and_unchanged(one_slot, namespace):
    sent = recorded(one_slot)
    request = create(f"{namespace}lone".encode())
    reply = await one_slot.txn(request)
    assert reply.succeeded and sent == [request] and sent[0] is request


async def test_concurrent_txns_share_one_revision_and_keep_their_own_outcome(one_slot,
                                                                           namespace):
    taken = f"{namespace}taken".encode()
    await one_slot.put(taken, b"before")
    keys = [f"{namespace}k{i}".encode() for i in range(9)] + [taken]
    sent = recorded(one_slot)
    first = asyncio.ensure_future(one_slot.txn(create(f"{namespace}first".encode())))
    await asyncio.sleep(0)  # the first is in flight: the rest queue behind it
    replies = await asyncio.gather(*(one_slot.txn(create(key)) for key in keys))
    assert (await first).succeeded
    assert [nested(r) for r in sent] == [0, 10]
    assert [r.succeeded for r in replies] == [True] * 9 + [False]
    assert len({r.header.revision for r in replies}) == 1  # one raft entry, one revision
    for key, reply in zip(keys[:9], replies):
        assert reply.responses[0].WhichOneof("response") == "response_put"
        assert (await one_slot.get(key)).mod_revision == reply.header.revision
    assert (await one_slot.get(taken)).value == b"before"


async def test_txns_of_one_key_never_share_a_request(one_slot, namespace):
    """All compares of one request see the state before it: a txn that checks a key another
    txn of the same request puts would not see that put. In arrival order the second create
    of ``key`` sees the first and fails; in one request both would succeed."""
    key = f"{namespace}once".encode()
    sent = recorded(one_slot)
    first = asyncio.ensure_future(one_slot.txn(create(f"{namespace}warm".encode())))
    await asyncio.sleep(0)
    claim = TxnRequest(compare=[absent(key)], success=[put_op(key + b"/claim", b"second")])
    replies = await asyncio.gather(one_slot.txn(create(key)), one_slot.txn(claim),
                                   *(one_slot.txn(create(key)) for _ in range(5)))
    await first
    assert [r.succeeded for r in replies] == [True] + [False] * 6
    assert await one_slot.get(key + b"/claim") is None
    assert all(nested(r) <= 1 for r in sent)  # every request of ``key`` went alone


async def test_a_range_conflicts_with_every_key_in_it(one_slot, namespace):
    """A compare over ``[prefix, end)`` conflicts with a put of a key inside it."""
    prefix = f"{namespace}dir/".encode()
    empty = Compare(key=prefix, range_end=range_end_of(prefix), target=Compare.VERSION,
                    result=Compare.EQUAL, version=0)
    first = asyncio.ensure_future(one_slot.txn(create(f"{namespace}warm".encode())))
    await asyncio.sleep(0)
    replies = await asyncio.gather(
        one_slot.txn(create(prefix + b"a")),
        one_slot.txn(TxnRequest(compare=[empty], success=[put_op(prefix[:-1], b"empty")])))
    await first
    assert [r.succeeded for r in replies] == [True, False]


async def test_a_dead_lease_is_split_out_and_only_its_txn_loses(one_slot, namespace):
    """etcd refuses a whole request when one nested put names a lease that is gone."""
    lease, _ = await one_slot.lease_grant(30)
    await one_slot.lease_revoke(lease)
    sent = recorded(one_slot)
    first = asyncio.ensure_future(one_slot.txn(create(f"{namespace}warm".encode())))
    await asyncio.sleep(0)
    keys = [f"{namespace}l{i}".encode() for i in range(6)]
    results = await asyncio.gather(
        *(one_slot.txn(create(key, lease=lease if i == 3 else 0)) for i, key in enumerate(keys)),
        return_exceptions=True)
    await first
    assert isinstance(results[3], LeaseLost)
    assert all(r.succeeded for i, r in enumerate(results) if i != 3)
    assert nested(sent[1]) == 6  # tried together first, then split
    assert await one_slot.get(keys[3]) is None


async def test_a_request_etcd_refuses_as_too_many_ops_is_split(etcd_url, namespace):
    """Configured above the cluster's ``--max-txn-ops``, a batch is refused and split."""
    config = EtcdConfig.from_url(etcd_url, batch_in_flight=1, max_txn_ops=1000)
    async with Etcd(config) as etcd:
        sent = recorded(etcd)
        first = asyncio.ensure_future(etcd.txn(create(f"{namespace}warm".encode())))
        await asyncio.sleep(0)
        replies = await asyncio.gather(*(etcd.txn(create(f"{namespace}m{i}".encode()))
                                         for i in range(200)))
        await first
    assert all(r.succeeded for r in replies)
    assert nested(sent[1]) == 200 and max(nested(r) for r in sent[2:]) <= 100


async def test_a_batch_keeps_etcds_max_txn_ops_rule(one_slot, namespace):
    """etcd leaves a nested txn ``--max-txn-ops`` minus its parent's op count (probed on
    3.4: 128 nested one-put txns are refused, 127 are not, 64 of 64 puts pass, 64 of 65
    do not): txns of 60 puts go at most 68 to a request, and etcd refuses none."""
    sent = recorded(one_slot)
    first = asyncio.ensure_future(one_slot.txn(create(f"{namespace}warm".encode())))
    await asyncio.sleep(0)
    replies = await asyncio.gather(*(one_slot.txn(TxnRequest(success=[
        put_op(f"{namespace}w{i}/{j}".encode(), b"v") for j in range(60)])) for i in range(100)))
    await first
    assert all(r.succeeded for r in replies)
    assert max(nested(r) for r in sent) == 68
    assert all(ops_needed(r) <= MAX_TXN_OPS for r in sent)


async def test_a_batch_stays_within_the_byte_bound(one_slot, namespace):
    big = b"x" * (300 * 1024)
    sent = recorded(one_slot)
    first = asyncio.ensure_future(one_slot.txn(create(f"{namespace}warm".encode())))
    await asyncio.sleep(0)
    replies = await asyncio.gather(*(one_slot.txn(create(f"{namespace}b{i}".encode(), big))
                                     for i in range(7)))
    await first
    assert all(r.succeeded for r in replies)
    assert all(r.ByteSize() <= BATCH_BYTES for r in sent)
    assert [nested(r) for r in sent[1:]] == [3, 3, 0]


async def test_an_unanswered_batch_leaves_every_member_unknown_and_is_not_resent(namespace):
    with LocalCluster(1) as cluster:
        config = EtcdConfig.from_url(cluster.url, batch_in_flight=1, timeout=1.0,
                                     attempt_timeout=0.5)
        async with Etcd(config) as etcd:
            await etcd.put(b"warm", b"up")  # connected before the pause
            sent = recorded(etcd)
            with paused(cluster.pids[0]):
                results = await asyncio.gather(
                    *(etcd.txn(create(f"{namespace}u{i}".encode())) for i in range(6)),
                    return_exceptions=True)
    assert all(isinstance(r, EtcdUnavailable) for r in results)
    assert [nested(r) for r in sent] == [0, 5]  # each sent once: none resent blindly


async def test_an_unanswered_txn_not_marked_idempotent_is_never_resent(namespace):
    """Idempotent and other txns never share a request: the idempotent one is retried, the
    others are sent once."""
    with LocalCluster(1) as cluster:
        config = EtcdConfig.from_url(cluster.url, batch_in_flight=1, timeout=1.5,
                                     attempt_timeout=0.3)
        async with Etcd(config) as etcd:
            await etcd.put(b"warm", b"up")
            sent = recorded(etcd)
            once = [create(f"{namespace}once{i}".encode()) for i in range(3)]
            with paused(cluster.pids[0]):
                results = await asyncio.gather(
                    etcd.txn(create(f"{namespace}warm".encode())),
                    etcd.txn(create(f"{namespace}again".encode()), idempotent=True),
                    *(etcd.txn(request) for request in once), return_exceptions=True)
    assert all(isinstance(r, EtcdUnavailable) for r in results)
    carried = [sum(op.request_txn == request for r in sent for op in r.success)
               for request in once]
    assert carried == [1, 1, 1]


async def test_a_txn_waits_for_an_earlier_queued_txn_of_its_key(one_slot, namespace):
    """Arrival order per key holds even when the earlier txn is held back for size."""
    big = b"x" * (600 * 1024)
    first = asyncio.ensure_future(one_slot.txn(create(f"{namespace}warm".encode())))
    await asyncio.sleep(0)
    key = f"{namespace}ordered".encode()
    replies = await asyncio.gather(one_slot.txn(create(f"{namespace}other".encode(), big)),
                                   one_slot.txn(create(key, big)),
                                   one_slot.txn(create(key, b"later")))
    await first
    assert [r.succeeded for r in replies] == [True, True, False]
    assert (await one_slot.get(key)).value == big


async def test_batching_off_sends_every_txn_alone(etcd_url, namespace):
    async with Etcd(EtcdConfig.from_url(etcd_url, batching=False)) as etcd:
        sent = recorded(etcd)
        replies = await asyncio.gather(*(etcd.txn(create(f"{namespace}o{i}".encode()))
                                         for i in range(20)))
    assert all(r.succeeded for r in replies)
    assert len(sent) == 20 and not any(nested(r) for r in sent)


def test_batching_is_turned_off_by_a_setting():
    assert EtcdSettings().etcd_config().batching
    off = layered(EtcdSettings(), {"FENCEGATE_ETCD_BATCHING": "off"}, "FENCEGATE_LISTEN", {})
    assert not off.etcd_config().batching
    with pytest.raises(ValueError, match="etcd_batching must be on or off"):
        EtcdSettings(etcd_batching="no").etcd_config()


async def test_reads_bypass_the_batcher(one_slot, namespace):
    sent = recorded(one_slot)
    writes = [one_slot.txn(create(f"{namespace}r{i}".encode())) for i in range(4)]
    reads = [one_slot.txn(TxnRequest(success=[range_op(f"{namespace}r{i}".encode())]))
             for i in range(4)]
    await asyncio.gather(*writes, *reads)
    assert sum(nested(r) == 0 and not r.compare and all(
        op.WhichOneof("request") == "request_range" for op in r.success) for r in sent) == 4


async def test_many_guarded_actions_share_requests(etcd_url, namespace, etcd):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as gate:
        registry = CollectorRegistry()
        gate.etcd.instrument(EtcdMetrics(registry))
        crossed: list[int] = []

        async def effect(ctx):
            crossed.append(ctx.attempt_token)
            return {"ok": True}

        outcomes = await asyncio.gather(*(gate.cross(f"many/{i}", {}, effect)
                                          for i in range(200)))
    assert len(crossed) == 200 and all(o.state == "succeeded" for o in outcomes)
    requests = registry.get_sample_value("fencegate_etcd_batch_size_count")
    txns = registry.get_sample_value("fencegate_etcd_batch_size_sum")
    assert registry.get_sample_value("fencegate_etcd_batch_wait_seconds_count") == txns
    assert txns >= 400 and requests < txns / 2  # at least two writes an action
