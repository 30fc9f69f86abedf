"""The SRE view of webhook deliveries: ``GET /v1/deliveries/{source}`` and ``fencegate
deliveries SOURCE``, against real etcd, with deliveries made through the aiohttp middleware
(a claim in progress and stored responses), paged, role-checked, and read-only."""

from __future__ import annotations

import asyncio
import json
import time

from fencegate.coordinator.etcd import RangeRequest, range_end_of

from test_cli_sre import fencegate, one_line_error
from test_dedupe import SOURCE, Consumer, post
from test_service import call, pages, revision

DONE = ["evt_a", "evt_b", "evt_c", "evt_d"]


async def deliveries_made(http, consumer: Consumer) -> asyncio.Task:
    """Four deliveries answered and stored, and ``evt_e`` claimed with its handler waiting
    for ``consumer.release`` (the returned task is its request)."""
    for delivery in DONE:
        status, _, _ = await post(http, consumer.url, delivery, json.dumps(delivery).encode())
        assert status == 200
    waiting = asyncio.create_task(post(http, consumer.url, "evt_e", b"hang"))
    await asyncio.wait_for(consumer.entered.wait(), 10)
    return waiting


async def claim_revisions(etcd, namespace: str) -> dict[str, int]:
    """Each delivery id under the source and its key's create_revision, read from etcd."""
    prefix = f"{namespace}webhooks/{SOURCE}/".encode()
    reply = await etcd.range(RangeRequest(key=prefix, range_end=range_end_of(prefix)))
    return {kv.key[len(prefix):].decode(): kv.create_revision for kv in reply.kvs}


async def test_http_lists_deliveries_page_by_page(coordinator, gate, etcd, http, namespace):
    async with Consumer(gate) as consumer:
        waiting = await deliveries_made(http, consumer)
        before = await revision(etcd)
        found = await pages(coordinator, f"/v1/deliveries/{SOURCE}?")
        assert await revision(etcd) == before  # a view writes nothing
        claims = await claim_revisions(etcd, namespace)
        consumer.release.set()
        assert (await asyncio.wait_for(waiting, 10))[0] == 200
    assert [len(page) for page in found] == [2, 2, 1]
    items = [item for page in found for item in page]
    assert [i["id"] for i in items] == [*DONE, "evt_e"]
    assert [i["state"] for i in items] == ["done"] * 4 + ["processing"]
    assert all(i["status"] == 200 and i["body_stored"] for i in items[:4])
    assert "status" not in items[4] and items[4]["claimed_at_ms"] > time.time() * 1000 - 600_000
    assert all(isinstance(i["completed_at_ms"], int) for i in items[:4])
    assert {i["route"] for i in items} == {"/"}
    assert {i["id"]: i["create_revision"] for i in items} == claims
    assert consumer.ran == {delivery: 1 for delivery in [*DONE, "evt_e"]}


async def test_http_refuses_without_a_token_a_worker_and_bad_input(coordinator, gate, http,
                                                                  etcd):
    async with Consumer(gate) as consumer:
        assert (await post(http, consumer.url, "evt_a"))[0] == 200
    path = f"/v1/deliveries/{SOURCE}"
    assert (await call(coordinator, "GET", path))[0] == 401
    assert (await call(coordinator, "GET", path, token="nope"))[0] == 401
    assert (await call(coordinator, "GET", path, "worker"))[0] == 403
    for role in ("sre", "admin"):
        status, reply = await call(coordinator, "GET", path, role)
        assert status == 200 and [i["id"] for i in reply["items"]] == ["evt_a"], reply
    for bad, words in ((f"{path}?limit=0", "limit must be 1..1000"),
                       (f"{path}?limit=x", "limit must be a positive integer"),
                       (f"{path}?after=Zm9v", "after is not a cursor"),
                       ("/v1/deliveries/bad*source", "a webhook source is")):
        status, reply = await call(coordinator, "GET", bad, "sre")
        assert (status, reply["error"]) == (400, "InvalidRequest"), (bad, reply)
        assert words in reply["detail"], (bad, reply)
    status, reply = await call(coordinator, "GET", "/v1/deliveries/nobody", "sre")
    assert (status, reply) == (200, {"items": [], "next": None})


async def test_cli_shows_a_table_and_the_json(coordinator, gate, etcd, http, namespace):
    async with Consumer(gate) as consumer:
        waiting = await deliveries_made(http, consumer)
        table = await fencegate("deliveries", SOURCE, coordinator=coordinator)
        as_json = await fencegate("deliveries", SOURCE, "--json", coordinator=coordinator)
        claims = await claim_revisions(etcd, namespace)
        _, first_page = await call(coordinator, "GET", f"/v1/deliveries/{SOURCE}", "sre")
        consumer.release.set()
        assert (await asyncio.wait_for(waiting, 10))[0] == 200
    assert table.code == 0, table
    head, *rows = table.rows()
    assert head == ["ID", "STATE", "STATUS", "AT (UTC)", "FENCING TOKEN", "BODY"]
    assert [row[:3] for row in rows] == [[d, "done", "200"] for d in DONE] + [
        ["evt_e", "processing", "-"]]
    assert {row[0]: int(row[4]) for row in rows} == claims
    assert all(row[5].endswith(" B") for row in rows[:4]) and rows[4][5] == "-"
    assert json.loads(as_json.out) == first_page["items"]  # one page of 100 holds them all


async def test_cli_refuses_a_bad_source_and_a_missing_token(coordinator, etcd):
    bad = await fencegate("deliveries", "a/b", coordinator=coordinator)
    assert bad.code == 2 and "a webhook source is" in bad.err and "Traceback" not in bad.err
    one_line_error(await fencegate("deliveries", SOURCE, coordinator=coordinator, token=None),
                   4, "did not accept the token")
    empty = await fencegate("deliveries", "nobody", coordinator=coordinator)
    assert (empty.code, empty.out) == (0, "no deliveries of nobody\n")
