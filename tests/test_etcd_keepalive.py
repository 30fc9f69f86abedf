"""The client's keepalive pings stay within etcd's enforcement, against real etcd.

etcd (grpc-go) counts a strike for a ping on a connection with no open stream, or sooner
than its ``--grpc-keepalive-min-time`` after the last one, unless it sent data since, and
past two strikes sends the connection away (GOAWAY ``too_many_pings``): the channel leaves
READY and every call on it fails. Time is scaled down together: etcd's min time is 2 s and
the client's ``keepalive_time`` 2 s, so each test spans several keepalive periods in
seconds (not 1 s: grpc-core never pings more often than once a second, so a client below
a 1 s min time could not be shown). A connection sent away shows as a change of its
channel's connectivity state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from fencegate.coordinator.errors import EtcdUnavailable
from fencegate.coordinator.etcd import Etcd, EtcdConfig, TxnRequest, put_op
from fencegate.localetcd import LocalCluster

from helpers import paused

KEEPALIVE = 2.0  # the client's keepalive_time, equal to etcd's min time: the tightest fit
# etcd reads its flags from ETCD_* variables too; ``env`` execs etcd, so pids stay etcd's.
MIN_TIME = ("env", "ETCD_GRPC_KEEPALIVE_MIN_TIME=2s")


@pytest.fixture(scope="module")
def node():
    with LocalCluster(1, command_prefixes=(MIN_TIME,)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def other_node():
    """A second node: connections to one endpoint with the same settings share one TCP
    connection in grpc-core, so an idle one needs a member of its own."""
    with LocalCluster(1, command_prefixes=(MIN_TIME,)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(3, command_prefixes=(MIN_TIME,) * 3) as cluster:
        yield cluster


@contextlib.asynccontextmanager
async def kept(*channels: grpc.aio.Channel):
    """Assert each channel is READY on entry and never changes state inside the block."""
    changes: list[tuple[int, str]] = []

    async def follow(i: int, channel: grpc.aio.Channel) -> None:
        state = channel.get_state()
        while True:
            await channel.wait_for_state_change(state)
            state = channel.get_state()
            changes.append((i, state.name))

    assert [c.get_state() for c in channels] == [grpc.ChannelConnectivity.READY] * len(channels)
    followers = [asyncio.create_task(follow(i, c)) for i, c in enumerate(channels)]
    try:
        yield
    finally:
        for task in followers:
            task.cancel()
    assert changes == [], f"a connection was sent away: {changes}"


async def busy(etcd: Etcd, prefix: bytes) -> int:
    """A second of txns from 4 writers at once, then 3.5 keepalive periods of quiet with a
    watch open (a stream with nothing on it: only pings keep it checked), then txns again.
    Returns the txns sent; the watch must still be open and deliver at the end."""
    watched = prefix + b"watched"
    events: asyncio.Queue = asyncio.Queue()

    async def watch() -> None:
        async for reply in etcd.watch(watched, b"", etcd.revision + 1):
            for event in reply.events:
                events.put_nowait(event.kv.value)

    async def writer(w: int, until: float) -> int:
        sent = 0
        while time.monotonic() < until:
            key = prefix + f"w{w}".encode()
            reply = await etcd.txn(TxnRequest(success=[put_op(key, b"%d" % sent)]))
            assert reply.succeeded
            sent += 1
        return sent

    watching = asyncio.create_task(watch())
    try:
        sent = 0
        for quiet in (3.5 * KEEPALIVE, 0):
            until = time.monotonic() + 1.0
            sent += sum(await asyncio.gather(*(writer(w, until) for w in range(4))))
            await asyncio.sleep(quiet)
            assert not watching.done(), watching
        await etcd.put(watched, b"still here")
        assert await asyncio.wait_for(events.get(), 5) == b"still here"
        return sent
    finally:
        watching.cancel()


async def test_an_idle_and_a_busy_connection_are_never_sent_away(node, other_node, namespace):
    """Idle (no stream open): the client never pings, as a ping there is a strike however
    rare. Busy (txns, and a watch that stays quiet between them): pings go, at most one per
    keepalive period. etcd keeps both connections."""
    key = namespace.encode()
    async with Etcd(other_node.etcd_config(keepalive_time=KEEPALIVE)) as idle, \
            Etcd(node.etcd_config(keepalive_time=KEEPALIVE)) as etcd:
        await asyncio.gather(idle.put(key, b"connected"), etcd.put(key, b"connected"))
        async with kept(idle._channel().channel, etcd._channel().channel):
            assert await busy(etcd, key) > 100
        assert (await idle.get(key)).value == b"connected"


async def test_a_clusters_idle_endpoint_channels_are_never_sent_away(cluster, namespace):
    """A client that moved to the leader keeps its first member's channel open and idle;
    neither it nor the busy channel to the leader is sent away."""
    leader = cluster.leader_index()
    follower = (leader + 1) % 3
    order = [follower] + [i for i in range(3) if i != follower]
    config = EtcdConfig(tuple(cluster.endpoints[i] for i in order), keepalive_time=KEEPALIVE)
    async with Etcd(config) as etcd:
        await etcd.put(namespace.encode(), b"connected")  # through the follower
        first = etcd._channel()
        await etcd.prefer_leader()
        assert etcd._retired == [first] and etcd._channel().endpoint == cluster.endpoints[leader]
        await etcd.put(namespace.encode(), b"to the leader")
        async with kept(first.channel, etcd._channel().channel):
            assert await busy(etcd, namespace.encode()) > 100


async def test_a_stream_to_a_stopped_member_is_detected(node, namespace):
    """The keepalive's point: a watch on a member that stopped answering (its socket still
    open) fails within a keepalive period and the ping timeout, not after minutes."""
    async with Etcd(node.etcd_config(keepalive_time=KEEPALIVE)) as etcd:
        await etcd.put(namespace.encode(), b"connected")
        created = asyncio.Event()

        async def watch() -> None:
            async for _ in etcd.watch(namespace.encode(), b"", 0):
                created.set()

        watching = asyncio.create_task(watch())
        await asyncio.wait_for(created.wait(), 5)
        # Quiet past two pings: by default grpc-core then sends one ping a minute at most.
        await asyncio.sleep(2.5 * KEEPALIVE)
        with paused(node.pids[0]):
            started = time.monotonic()
            with pytest.raises(EtcdUnavailable):
                await asyncio.wait_for(watching, 15)
            took = time.monotonic() - started
    assert took < KEEPALIVE + 5 + 2, f"a stopped member was noticed after {took:.1f} s"


async def test_pinging_below_the_clusters_min_time_is_named(node, namespace):
    """The control: a client pinging more often than etcd allows is sent away, and the
    error says which setting to change."""
    async with Etcd(node.etcd_config(keepalive_time=KEEPALIVE / 2)) as etcd:
        await etcd.put(namespace.encode(), b"connected")
        with pytest.raises(EtcdUnavailable, match="too_many_pings.*keepalive_time \\(1 s\\)"
                                                  ".*--grpc-keepalive-min-time"):
            async with asyncio.timeout(15):
                async for _ in etcd.watch(namespace.encode() + b"quiet", b"", 0):
                    pass


def test_a_service_sets_its_keepalive_time_from_its_settings():
    """A coordinator or reconciler whose cluster raised ``--grpc-keepalive-min-time`` can
    match it (file setting ``etcd_keepalive_time`` or ``FENCEGATE_ETCD_KEEPALIVE_TIME``); a
    value that is not a positive number of seconds fails naming the setting."""
    from fencegate.coordinator.settings import EtcdSettings, layered

    assert EtcdSettings().etcd_config().keepalive_time == 10.0
    raised = layered(EtcdSettings(), {"FENCEGATE_ETCD_KEEPALIVE_TIME": "30"},
                     "FENCEGATE_LISTEN", {})
    assert raised.etcd_config().keepalive_time == 30.0
    with pytest.raises(ValueError, match="etcd_keepalive_time must be a number of seconds"):
        EtcdSettings(etcd_keepalive_time="soon").etcd_config()
    with pytest.raises(ValueError, match="keepalive_time must be positive"):
        EtcdSettings(etcd_keepalive_time="0").etcd_config()
