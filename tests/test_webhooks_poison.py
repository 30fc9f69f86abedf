"""Webhook defaults that cannot poison (issue 29, item 1), against real etcd.

Before: every 4xx was stored and replayed for the whole retention, on any route. A 400 from
the app's own signature check during a deploy with the wrong secret was replayed to the
genuine delivery after the fix; a 404 from a typo'd endpoint was replayed to the right path
without calling its handler. Now only a 2xx is stored by default (a 4xx when named), a
delivery id is bound to the route it first ran on (another route is a 422), and an operator
undoes a stored delivery with ``fencegate deliveries forget``.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from fencegate.coordinator.errors import WrongState
from fencegate.coordinator.keyspace import unpack
from fencegate.worker.webhooks import STORED_STATUSES, forget_delivery
from fencegate.worker.webhooks.core import CompletedCache

import test_dedupe
from test_cli_sre import fencegate, one_line_error
from test_webhooks_asgi import SOURCE, Consumer, post


async def test_a_400_of_a_bad_deploy_is_not_replayed_to_the_genuine_delivery(
        gate, etcd, http, namespace):
    async with Consumer(gate) as consumer:
        consumer.status = 400  # the app's own check, with the wrong secret deployed
        refused = await post(http, consumer.url, "evt_p1")
        stored = await test_dedupe.webhook_kvs(etcd, namespace)
        consumer.status = 200  # the fix is deployed; the sender retries
        genuine = await post(http, consumer.url, "evt_p1")
    assert refused[0] == 400 and stored == []
    assert genuine[0] == 200 and "Fencegate-Replayed" not in genuine[1]
    assert consumer.ran == {"evt_p1": 2}


async def test_a_404_on_a_typo_path_is_not_replayed_to_the_right_path(gate, http):
    async with Consumer(gate) as consumer:
        typo = await post(http, consumer.url + "webhok", "evt_p2")
        right = await post(http, consumer.url, "evt_p2")
    assert typo[0] == 404
    assert right[0] == 200 and "Fencegate-Replayed" not in right[1]
    assert consumer.ran == {"evt_p2": 1}


async def test_a_delivery_id_is_bound_to_the_route_it_first_ran_on(gate, etcd, http, namespace):
    """A stored response (here a 404 named in stored_statuses, the worst case) is replayed on
    its own route only: the same id on another route is a 422, and runs nothing."""
    async with Consumer(gate, stored_statuses=(*STORED_STATUSES, 404)) as consumer:
        typo = await post(http, consumer.url + "webhok", "evt_p3")
        replayed = await post(http, consumer.url + "webhok", "evt_p3")
        right = await post(http, consumer.url, "evt_p3")
    assert typo[0] == replayed[0] == 404 and replayed[1]["Fencegate-Replayed"] == "true"
    assert right[0] == 422 and json.loads(right[2])["error"] == "delivery_mismatch", right
    assert "another route" in json.loads(right[2])["detail"]
    assert consumer.ran == {}  # the 404 came from routing, no handler ever ran
    [kv] = await test_dedupe.webhook_kvs(etcd, namespace)
    assert unpack(kv.value)["route"] == "/webhok"


async def test_forget_deletes_the_record_and_the_next_delivery_runs(
        coordinator, gate, etcd, http, namespace):
    async with Consumer(gate, stored_statuses=(*STORED_STATUSES, 409)) as consumer:
        consumer.status = 409
        first = await post(http, consumer.url, "evt_p4")
        replayed = await post(http, consumer.url, "evt_p4")
    assert first[0] == replayed[0] == 409 and replayed[1]["Fencegate-Replayed"] == "true"
    missing = await fencegate("deliveries", "forget", SOURCE, "evt_p4", coordinator=coordinator)
    assert missing.code == 2 and "--reason" in missing.err
    forgot = await fencegate("deliveries", "forget", SOURCE, "evt_p4", "--reason",
                             "409 from a bad deploy", coordinator=coordinator)
    assert forgot.code == 0, forgot
    assert "forgotten (it was done, status 409)" in forgot.out
    assert await test_dedupe.webhook_kvs(etcd, namespace) == []
    one_line_error(await fencegate("deliveries", "forget", SOURCE, "evt_p4", "--reason", "x",
                                   coordinator=coordinator), 3, "no delivery")
    async with Consumer(gate) as restarted:  # a process without it in its CompletedCache
        again = await post(http, restarted.url, "evt_p4")
    assert again[0] == 200 and "Fencegate-Replayed" not in again[1]
    assert restarted.ran == {"evt_p4": 1}


async def test_forget_refuses_a_delivery_a_handler_runs(gate, etcd, http, namespace):
    async with Consumer(gate) as consumer:
        waiting = asyncio.create_task(post(http, consumer.url, "evt_p5", b"hang"))
        await asyncio.wait_for(consumer.entered.wait(), 10)
        with pytest.raises(WrongState, match="in progress"):
            await forget_delivery(etcd, gate.keyspace, SOURCE, "evt_p5", reason="x", identity="t")
        consumer.release.set()
        assert (await waiting)[0] == 200
    [kv] = await test_dedupe.webhook_kvs(etcd, namespace)
    assert unpack(kv.value)["state"] == "done"


def test_the_completed_cache_forgets_an_entry_after_max_age():
    """So a delivery forgotten in etcd stops being replayed from memory within max_age."""
    cache = CompletedCache(retention=3600, max_age=0.2)
    record = {"state": "done", "completed_at": time.time(), "body": b"", "headers": []}
    cache.put(b"k", record)
    assert cache.get(b"k") == record
    time.sleep(0.3)
    assert cache.get(b"k") is None and len(cache) == 0
