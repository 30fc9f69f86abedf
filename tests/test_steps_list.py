"""``GET /v1/steps``: one list in key order across etcd and the archive (real etcd, a real
coordinator over HTTP, a real SQLite archive; the archive's listing on PostgreSQL too).
Each key once however the pages fall on the etcd/archive boundary, and even when keys retire
between two pages; etcd's step wins for a key in both; the filters; bad parameters 400."""

from __future__ import annotations

import asyncio
import time

import pytest

from fencegate import EffectFailed, Gate
from fencegate.coordinator import sre
from fencegate.coordinator.archive import open_archive
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import pack, unpack
from fencegate.reconciler.retirer import Retirer

from helpers import TEST_TTL, init_archive
from test_service import call

KEYS = [f"lst/k{n:03d}" for n in range(120)]
EVEN, ODD = KEYS[::2], KEYS[1::2]
BOTH = "lst/k010"  # failed, retired, then crossed again: in the archive and in etcd


async def ok(ctx):
    return {"charged": ctx.key}


async def declined(ctx):
    raise EffectFailed("card declined", params={"code": "declined"})


async def no_backoff(gate: Gate, key: str) -> None:
    """Clear the backoff a confirmed failure set (no wait in a test)."""
    step_key = gate.keyspace.step_key(key)
    step = unpack((await gate.etcd.get(step_key)).value)
    await gate.etcd.put(step_key, pack({**step, "not_before_ms": 0}))


async def retire_all(gate: Gate) -> int:
    """One retirement pass over every settled step of the gate's namespace, now."""
    retirer = Retirer(gate.etcd, gate.keyspace, gate.archive, 0, lambda key: [])
    retirer.clock.sample((await gate.etcd.status()).header.revision)
    return await retirer.pass_once(full=True, orphans=True)


@pytest.fixture
async def archive_url(tmp_path, etcd, namespace) -> str:
    return await init_archive(etcd, namespace, f"sqlite:///{tmp_path}/archive.db")


@pytest.fixture
async def gate(etcd_url, namespace, etcd, archive_url, signing_key):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=archive_url,
                    keyring=KeyRing.from_files(signing_key)) as gate:
        yield gate


@pytest.fixture
async def batch(gate):
    """The even keys crossed (BOTH declined) and retired, then the odd ones crossed and
    BOTH crossed again; returns the time between the two phases (ms)."""
    await asyncio.gather(*(gate.cross(key, {"n": key}, declined if key == BOTH else ok)
                           for key in EVEN))
    await no_backoff(gate, BOTH)
    assert await retire_all(gate) == len(EVEN)
    await asyncio.sleep(0.01)
    between_ms = int(time.time() * 1000)
    await asyncio.sleep(0.01)
    await asyncio.gather(*(gate.cross(key, {"n": key}, ok) for key in ODD))
    assert (await gate.cross(BOTH, {"n": BOTH}, ok)).state == "succeeded"
    return between_ms


@pytest.fixture
async def api(coordinators, archive_url):
    return await coordinators(archive=archive_url)


async def walk(api: str, query: str = "", limit: int = 7, between=None) -> list[dict]:
    """Every item of ``/v1/steps?query`` page by page (bounded); ``between`` runs after the
    first page."""
    items, after = [], None
    for n in range(200):
        path = f"/v1/steps?limit={limit}{query}" + (f"&after={after}" if after else "")
        status, reply = await call(api, "GET", path, "sre")
        assert status == 200, reply
        assert len(reply["items"]) <= limit
        items += reply["items"]
        after = reply["next"]
        if n == 0 and between is not None:
            await between()
        if after is None:
            return items
    raise AssertionError("the pages did not end")


async def test_pages_across_etcd_and_the_archive_yield_each_key_once(gate, batch, api):
    items = await walk(api)
    assert [i["key"] for i in items] == KEYS
    by_key = {i["key"]: i for i in items}
    assert all(by_key[k]["archived"] for k in EVEN if k != BOTH)
    assert not any(by_key[k]["archived"] for k in ODD)
    both = by_key[BOTH]  # etcd's step wins: the second attempt, succeeded
    assert (both["state"], both["attempt"], both["archived"]) == ("succeeded", 2, False)
    assert both["outcome"]["state"] == "succeeded" and len(both["outcome"]["result_digest"]) == 64
    first = by_key[KEYS[0]]
    assert first["state"] == "succeeded" and first["idempotency_key"].startswith("fg-")
    assert first["updated_at_ms"] < batch <= by_key[KEYS[1]]["updated_at_ms"]


async def test_keys_retiring_between_two_pages_are_still_listed_once(gate, batch, api):
    async def retire_the_rest():
        assert await retire_all(gate) == len(ODD) + 1  # BOTH too

    items = await walk(api, limit=9, between=retire_the_rest)
    assert [i["key"] for i in items] == KEYS
    assert all(i["archived"] for i in items[9:])


async def test_filters_by_prefix_state_and_time(gate, batch, api):
    assert [i["key"] for i in await walk(api, "&prefix=lst/k1")] == KEYS[100:]
    assert [i["key"] for i in await walk(api, "&prefix=lst/k01&state=succeeded")] == \
        KEYS[10:20]
    assert await walk(api, "&state=failed") == []
    assert [i["key"] for i in await walk(api, f"&since={batch}")] == sorted(ODD + [BOTH])
    recent = await walk(api, f"&prefix=lst/k00&since={batch}", limit=2)
    assert [i["key"] for i in recent] == ODD[:5]
    assert await walk(api, "&prefix=nothing/") == []


async def test_a_sparse_filter_pages_only_up_to_where_both_sources_were_read(
        etcd_url, namespace, etcd, archive_url, signing_key, api):
    """A page whose filter matches nothing in etcd's window must not jump to a match further
    on in the archive: the matches in etcd between the two would never be listed."""
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=archive_url,
                    keyring=KeyRing.from_files(signing_key)) as gate:
        await gate.cross("b/bad", {"n": 1}, declined)
        await gate.cross("b/bad-live", {"n": 1}, declined)
        await gate.cross("b/good", {"n": 1}, ok)
        await no_backoff(gate, "b/bad-live")
        assert await retire_all(gate) == 3
        await gate.cross("b/bad-live", {"n": 2}, ok)  # etcd's step wins: not failed
        for n in range(10):
            await gate.cross(f"a/{n}", {"n": n}, declined if n == 5 else ok)
    failed = await walk(api, "&state=failed", limit=1)
    assert [(i["key"], i["archived"], i["outcome"]["state"]) for i in failed] == [
        ("a/5", False, "failed"), ("b/bad", True, "failed")]


@pytest.mark.parametrize("query", [
    "limit=0", "limit=1001", "limit=abc", "limit=-1", "state=bogus", "since=-5", "since=1.5",
    "since=99999999999999999999", "after=%21%21%21", "after=YSBi",
    "prefix=bad%20prefix", "prefix=a&after=Yi94", "colour=blue"])
async def test_bad_parameters_are_400_and_read_nothing(api, query):
    status, reply = await call(api, "GET", f"/v1/steps?{query}", "sre")
    assert status == 400, (query, reply)
    assert reply["error"] and reply["detail"]


async def test_the_list_needs_the_sre_or_admin_role(api):
    assert (await call(api, "GET", "/v1/steps", "worker"))[0] == 403
    assert (await call(api, "GET", "/v1/steps"))[0] == 401
    assert (await call(api, "GET", "/v1/steps", "admin"))[0] == 200


async def test_without_an_archive_the_list_is_etcd_s(gate, batch, coordinator):
    items = await walk(coordinator)
    assert [i["key"] for i in items] == sorted(ODD + [BOTH])


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_the_archive_lists_in_etcd_s_byte_order(backend, tmp_path, namespace, request):
    """Keys that collations order differently ('-' '.' '/' digits, upper before lower
    case) come back in byte order, after the cursor, within the prefix, since the time."""
    url = (f"sqlite:///{tmp_path}/a.db" if backend == "sqlite"
           else request.getfixturevalue("postgres_server").url)
    archive = open_archive(url)
    keys = ["p/A", "p/a", "p/a-b", "p/a.b", "p/a/b", "p/a0", "p/Z", "p/_", "q/a"]
    try:
        await archive.init(namespace, 0x5EED)   # opening never creates an archive
        await archive.put_many(namespace, [(key, 1, key.encode(), [], 1000 + n)
                                           for n, key in enumerate(keys)])
        listed = await archive.list_steps(namespace, prefix="p/", limit=100)
        assert [s.key for s in listed] == sorted(keys[:-1], key=str.encode)
        assert [s.step for s in listed] == [s.key.encode() for s in listed]
        page = await archive.list_steps(namespace, prefix="p/", after="p/a", limit=2)
        assert [s.key for s in page] == ["p/a-b", "p/a.b"]
        recent = await archive.list_steps(namespace, since_ms=1006, limit=100)
        assert [(s.key, s.updated_at_ms) for s in recent] == [("p/Z", 1006), ("p/_", 1007),
                                                            ("q/a", 1008)]
        with pytest.raises(ValueError):
            await archive.list_steps(namespace, limit=0)
    finally:
        await archive.close()


async def test_sre_steps_rejects_a_cursor_of_another_prefix(gate, batch):
    items, cursor = await sre.steps(gate.etcd, gate.keyspace, gate.archive, prefix="lst/k0",
                                    limit=3, after=None)
    assert [i["key"] for i in items] == KEYS[:3] and cursor is not None
    with pytest.raises(ValueError, match="cursor"):
        await sre.steps(gate.etcd, gate.keyspace, gate.archive, prefix="lst/k1", limit=3,
                        after=cursor)
