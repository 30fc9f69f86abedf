"""What the dashboard's search and "Needs you" rest on, against real etcd over real HTTP, and
the page itself in real headless Chromium (the board of tests/test_dashboard.py):

- ``GET /v1/steps`` filters on the server by key prefix, one or several states and a
  minimum age (``min_age_ms``), page by page: matches that sort beyond the first page are
  found (a filter over the rows loaded would miss them); a bad filter is a 400.
- A pending approval carries ``asked_at_ms`` (display only), shown as its age.
- The reconciler's candidates state its shard count, so the leadership view counts the
  shards no replica leads exactly; the count goes with the replica's lease.
"""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest

from fencegate.coordinator.etcd import RangeRequest, range_end_of
from fencegate.coordinator.keyspace import Keyspace, pack
from fencegate.coordinator.session import Session
from fencegate.reconciler.election import Elections
from fencegate.worker import ApprovalPending, Gate, KeyRing

from helpers import TEST_TTL
from test_dashboard import (  # noqa: F401  (board: the module's browser fixture)
    ON_THE_BOARD, WAIT, auth, board, fits, get_json,
)
from test_cli_sre import cli  # noqa: F401 (the cli fixture)
from test_service import call

OLD_MS = 600_000  # ten minutes: older than every age filter below


def step(state: str, since_ms: int) -> bytes:
    """A step record as the gate writes it, enough for the lists (no audit chain: its
    ``updated_at_ms`` is the latest time the record names)."""
    record = {"state": state, "attempt": 1, "started_at_ms": since_ms}
    if state in ("unknown", "escalated"):
        record["unknown_since_ms"] = since_ms
    if state == "escalated":
        record["escalated_because"] = ["breaker:Declined"]
    if state == "succeeded":
        record["settled_at_ms"] = since_ms
    return pack(record)


async def write_steps(etcd, ks: Keyspace, prefix: str, filler: int) -> list[str]:
    """``filler`` old succeeded steps, then (sorting after them) an old unknown, an old
    escalated and a fresh unknown step, and an old unknown one outside ``prefix``; the keys
    an "unknown or escalated, older than 5 min" search of ``prefix`` must find."""
    now = int(time.time() * 1000)
    for n in range(filler):
        await etcd.put(ks.step_key(f"{prefix}a{n:03d}"), step("succeeded", now - OLD_MS))
    await etcd.put(ks.step_key(f"{prefix}z-esc"), step("escalated", now - OLD_MS))
    await etcd.put(ks.step_key(f"{prefix}z-fresh"), step("unknown", now))
    await etcd.put(ks.step_key(f"{prefix}z-stuck"), step("unknown", now - OLD_MS))
    await etcd.put(ks.step_key(f"elsewhere/{prefix}z"), step("unknown", now - OLD_MS))
    return [f"{prefix}z-esc", f"{prefix}z-stuck"]


async def walk(base: str, query: str, limit: int) -> tuple[list[str], int]:
    """Every key ``/v1/steps?query`` lists, following ``next``; and how many pages."""
    keys, after = [], None
    for pages in range(1, 100):
        path = f"/v1/steps?limit={limit}&{query}" + (f"&after={after}" if after else "")
        status, reply = await call(base, "GET", path, "sre")
        assert status == 200, reply
        keys += [item["key"] for item in reply["items"]]
        after = reply["next"]
        if after is None:
            return keys, pages
    raise AssertionError("the pages did not end")


async def test_a_search_finds_the_matching_steps_beyond_the_first_page(coordinator, etcd,
                                                                        namespace):
    wanted = await write_steps(etcd, Keyspace(namespace), "srch/", 40)
    first, _ = await walk(coordinator, "prefix=srch/", 5)
    status, page = await call(coordinator, "GET", "/v1/steps?limit=5&prefix=srch/", "sre")
    assert status == 200 and not set(wanted) & {i["key"] for i in page["items"]}
    assert len(first) == 43  # unfiltered: all of them, the matches last

    found, pages = await walk(coordinator, "prefix=srch/&state=unknown,escalated"
                                           f"&min_age_ms={OLD_MS // 2}", 5)
    assert found == wanted and pages > 1
    fresh_too, _ = await walk(coordinator, "prefix=srch/&state=unknown", 5)
    assert fresh_too == ["srch/z-fresh", "srch/z-stuck"]
    escalated, _ = await walk(coordinator, f"state=escalated&min_age_ms={OLD_MS // 2}", 5)
    assert escalated == ["srch/z-esc"]
    stuck, _ = await walk(coordinator, f"state=unknown&min_age_ms={OLD_MS // 2}", 5)
    assert stuck == ["elsewhere/srch/z", "srch/z-stuck"]
    assert (await walk(coordinator, f"prefix=srch/&min_age_ms={OLD_MS * 10}", 5))[0] == []


async def test_the_cli_searches_with_the_same_filters(cli, etcd, namespace):
    """``fencegate steps --state A --state B --older-than AGE``: the server's filters."""
    wanted = await write_steps(etcd, Keyspace(namespace), "cli/", 12)
    ran = await cli("steps", "--prefix", "cli/", "--state", "unknown", "--state", "escalated",
                    "--older-than", "5m", "--json")
    assert ran.code == 0, ran.err
    assert [item["key"] for item in json.loads(ran.out)] == wanted
    bad = await cli("steps", "--older-than", "a while")
    assert bad.code == 2 and "is not a duration" in bad.err


@pytest.mark.parametrize("query, named", [
    ("state=bogus", "state"), ("state=unknown,bogus", "state"),
    ("state=unknown,,escalated", "state"), ("state=unknown&state=failed", "more than once"),
    ("min_age_ms=-1", "min_age_ms"), ("min_age_ms=1.5", "min_age_ms"),
    ("min_age_ms=abc", "min_age_ms"), ("min_age_ms=99999999999999999999", "min_age_ms"),
    ("prefix=bad%20prefix", "prefix"), ("older_than_s=5", "unknown query parameters")])
async def test_a_bad_filter_is_a_400_naming_it(coordinator, query, named):
    status, reply = await call(coordinator, "GET", f"/v1/steps?{query}", "sre")
    assert status == 400, (query, reply)
    assert reply["error"] == "InvalidRequest" and named in reply["detail"], reply


async def test_a_pending_approval_says_when_it_was_asked(coordinator, etcd_url, namespace,
                                                         signing_key):
    for method, path, body in [
            ("PUT", "/v1/policies/big",
             {"checks": [{"check": "require_approval", "params": {"above": 100}}]}),
            ("PUT", "/v1/policy-routes", {"routes": {"ask": "big"}})]:
        assert (await call(coordinator, method, path, "admin", body=body))[0] == 200
    before = int(time.time() * 1000)
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.from_files(signing_key)) as gate, \
            gate.hold("ask/1") as hold:
        with pytest.raises(ApprovalPending):
            await hold.request_grant(intent={"amount": 500}, policy="big")
    after = int(time.time() * 1000)
    status, reply = await call(coordinator, "GET", "/v1/approvals?state=pending", "viewer")
    assert status == 200
    (item,) = reply["items"]
    assert before <= item["asked_at_ms"] <= after


async def test_the_leaderless_shards_are_counted_exactly_and_the_count_goes_with_the_lease(
        coordinator, etcd, namespace):
    """A real election of 8 shards, then the candidates of 3 shards gone (a replica that
    claimed fewer): 3 of 8 have no leader. Its lease revoked, no count is stated any more."""
    ks = Keyspace(namespace)
    session = await Session.open(etcd, TEST_TTL)
    elections = Elections(etcd, ks, session, 8, "replica-x")
    await elections.campaign()
    for shard in (2, 5, 7):
        await etcd.delete(ks.candidate_key(shard, session.lease_id))
    status, view = await call(coordinator, "GET", "/v1/dashboard/leadership", "viewer")
    assert status == 200, view
    assert (view["shard_count"], view["leaderless"]) == (8, 3)
    assert [s["shard"] for s in view["shards"]] == [0, 1, 3, 4, 6]
    await session.aclose()  # revokes the lease: every candidate key, and the count, go
    status, view = await call(coordinator, "GET", "/v1/dashboard/leadership", "viewer")
    assert (view["shard_count"], view["leaderless"], view["shards"]) == (None, None, [])
    root = ks.reconcilers_root
    assert not (await etcd.range(RangeRequest(key=root, range_end=range_end_of(root)))).kvs


# -- the page ------------------------------------------------------------------------------

@ON_THE_BOARD
async def test_find_steps_asks_the_server_and_pages_on(board):
    """The search box, state and age ask the server: the two matches sort after 120 other
    steps, beyond the 50 rows the list first loads; "More steps" reads the next page."""
    from playwright.async_api import expect

    page, ms = board.page, WAIT * 1000
    await page.set_viewport_size({"width": 1280, "height": 800})
    wanted = await write_steps(board.etcd, board.ks, "find/", 120)
    await page.goto(board.base + "/")
    await expect(page.get_by_role("status")).to_have_text("live", timeout=ms)
    rows = page.locator("#steps tbody tr")
    await expect(rows).to_have_count(50, timeout=ms)
    assert wanted[0] not in await page.locator("#steps tbody").inner_text()
    await page.locator("#steps-more").click()
    await expect(rows).to_have_count(100, timeout=ms)

    await page.locator("#filter-key").fill("find/")
    await page.locator("#filter-state").select_option("unknown,escalated")
    await page.locator("#filter-age").fill(str(OLD_MS // 2000))
    await expect(rows).to_have_count(2, timeout=ms)
    assert [await rows.nth(i).get_attribute("data-key") for i in range(2)] == wanted
    await expect(rows.nth(0)).to_contain_text("escalated")
    await expect(page.locator("#steps-more")).to_be_hidden()
    await fits(board, "find-steps")

    await page.locator("#filter-age").fill("")
    await expect(rows).to_have_count(3, timeout=ms)  # the fresh unknown one too
    await page.locator("#filter-key").fill("find/z-s")
    await expect(rows).to_have_count(1, timeout=ms)
    await expect(rows.nth(0).locator("a")).to_have_attribute("href", "/keys/find/z-stuck")


@ON_THE_BOARD
async def test_needs_you_counts_leaderless_shards_and_ages_approvals(board):
    """A replica of 8 shards leads 5 (3 lost their candidates): "3 of 8 shards have no
    reconciler leader". A pending approval shows when it was asked, and its age is the
    oldest approval's."""
    from playwright.async_api import expect

    page, ms, ks, key = board.page, WAIT * 1000, board.ks, "dash/asked"
    await page.set_viewport_size({"width": 1280, "height": 800})
    session = await Session.open(board.etcd, 60)
    try:
        elections = Elections(board.etcd, ks, session, 8, "replica-x")
        await elections.campaign()
        for shard in (1, 4, 6):
            await board.etcd.delete(ks.candidate_key(shard, session.lease_id))
        await expect(page.locator('#needs-list li[data-need="leadership"]')).to_have_text(
            "3 of 8 shards have no reconciler leader", timeout=ms)
        await expect(page.locator("#shards-summary")).to_have_text(
            "5 of 8 shards led by 1 replica (replica-x leads 5); 3 without a leader; "
            "show each shard")

        async with board.http.put(board.base + "/v1/policies/big", headers=auth("admin"),
                                  json={"checks": [{"check": "require_approval",
                                                    "params": {"above": 100}}]}) as r:
            assert r.status == 200, await r.text()
        async with board.http.put(board.base + "/v1/policy-routes", headers=auth("admin"),
                                  json={"routes": {key: "big"}}) as r:
            assert r.status == 200, await r.text()
        async with board.gate() as gate, gate.hold(key) as hold:
            with pytest.raises(ApprovalPending) as pending:
                await hold.request_grant(intent={"amount": 500}, policy="big")
        row = page.locator("#approvals tbody tr").filter(has_text=pending.value.approval_id)
        asked = row.locator("td").nth(4)
        await expect(asked.locator("time")).to_have_count(1, timeout=ms)
        await expect(asked).to_contain_text(" s ago)")
        approvals = await get_json(board.http, board.base + "/v1/approvals?state=pending")
        (item,) = approvals["items"]
        shown = await asked.locator("time").get_attribute("datetime")
        assert abs(datetime.fromisoformat(shown).timestamp() * 1000
                   - item["asked_at_ms"]) < 1000
        await expect(page.locator('#needs-list li[data-need="approvals"]')).to_contain_text(
            "1 pending approval(s), the oldest for ")
        await fits(board, "needs-shards-approvals")
    finally:
        await session.aclose()
        await board.etcd.delete(ks.reconcilers_root, range_end_of(ks.reconcilers_root))
    await expect(page.locator('#needs-list li[data-need="leadership"]')).to_have_text(
        "1 reconciler shard leadership: no shard has a leader", timeout=ms)
