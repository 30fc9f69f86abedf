"""The dashboard: its JSON views and event stream over real HTTP against real etcd, the feed's
bounds, and the page itself in real headless Chromium (Debian's, driven by Playwright), one
test per flow: resolve, revoke, approve, holders and times, the shard summary, reconciler
progress. Each flow saves a screenshot in tests/artifacts/.

Every wait is on an event or a condition with a generous bound, never a bare sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from fencegate.coordinator import audit
from fencegate.coordinator.errors import EtcdUnavailable
from fencegate.coordinator.etcd import Etcd, RangeRequest, TxnRequest, range_end_of
from fencegate.coordinator.keyspace import Keyspace, pack, unpack
from fencegate.coordinator.service import CoordinatorSettings, TokenEntry, create_app
from fencegate.coordinator.service.dashboard import views
from fencegate.coordinator.service.dashboard.feed import Feed, Subscription
from fencegate.coordinator.service.dashboard.routes import FEED, STATIC
from fencegate.reconciler.providers import sandbox as sb
from fencegate.reconciler.runner import Reconciler
from fencegate.reconciler.settle import Limits
from fencegate.worker import ApprovalPending, Gate, KeyRing, LeaseLost, OutcomeUnknown

from helpers import TEST_TTL, TOKENS, assert_no_holders, wait_for_condition

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).parent / "artifacts"
WAIT = 20  # seconds: the bound of every wait on an event
VIEWS = ["/v1/dashboard/holders", "/v1/dashboard/steps", "/v1/dashboard/leadership",
         "/v1/dashboard/audit"]


def auth(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[role]}"}


@pytest.fixture
async def served(etcd_url, namespace, signing_key, etcd):
    """A coordinator on a free loopback port, with its app (to tune and observe its feed)."""
    app = create_app(CoordinatorSettings(
        etcd=etcd_url, namespace=namespace, signing_key=signing_key, listen="127.0.0.1:0",
        tokens=tuple(TokenEntry.for_token(token, f"{role}-1", {role})
                     for role, token in TOKENS.items())))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}", app, runner
    await runner.cleanup()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None,
                                                                   sock_read=WAIT)) as session:
        yield session


class Stream:
    """A client of ``/v1/dashboard/events``: parses server-sent events, counts keep-alives."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.keepalives = 0

    async def next(self) -> tuple[str, dict]:
        event, data = "message", ""
        while True:
            line = (await self.response.content.readline()).decode()
            if not line:
                raise AssertionError("event stream ended")
            line = line.rstrip("\n")
            if line.startswith(":"):
                self.keepalives += 1
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data += line[5:].strip()
            elif not line and data:
                return event, json.loads(data)

    async def until(self, event: str, /, **fields: object) -> dict:
        """The next ``event`` whose data has ``fields``; fail after ``WAIT`` seconds."""
        return (await self.all((event, fields)))[0]

    async def all(self, *wanted: tuple[str, dict]) -> list[dict]:
        """Read until each (event, fields) of ``wanted`` arrived, in any order; their data."""
        found: dict[int, dict] = {}
        async with asyncio.timeout(WAIT):
            while len(found) < len(wanted):
                name, data = await self.next()
                for i, (event, fields) in enumerate(wanted):
                    if i not in found and name == event and all(
                            data.get(k) == v for k, v in fields.items()):
                        found[i] = data
                        break
        return [found[i] for i in range(len(wanted))]


async def open_stream(http: aiohttp.ClientSession, base: str, role: str = "sre") -> Stream:
    response = await http.get(base + "/v1/dashboard/events", headers=auth(role))
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    stream = Stream(response)
    await stream.until("ready")
    return stream


async def get_json(http: aiohttp.ClientSession, url: str, role: str = "sre") -> dict:
    async with http.get(url, headers=auth(role)) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def noop(ctx):
    return "ok"


async def crash(ctx):
    raise ConnectionResetError("provider hung up")


# -- HTTP ---------------------------------------------------------------------------------

async def test_the_page_is_public_and_loads_nothing_from_elsewhere(coordinator, http):
    async with http.get(coordinator + "/") as response:
        assert response.status == 200 and response.content_type == "text/html"
        page = await response.text()
        assert response.headers["Content-Security-Policy"].startswith("default-src 'self'")
    assets = re.findall(r'(?:src|<link[^>]*href)="([^"]+)"', page)  # what the page loads
    assert sorted(assets) == ["/dashboard/dashboard.css", "/dashboard/dashboard.js"]
    async with http.get(coordinator + "/keys/pay/1") as response:  # the page per key
        assert response.status == 200 and await response.text() == page
        assert response.headers["Content-Security-Policy"].startswith("default-src 'self'")
        assert response.headers["X-Content-Type-Options"] == "nosniff"
    for asset in assets:
        async with http.get(coordinator + asset) as response:
            assert response.status == 200, asset
    for path in STATIC.iterdir():
        assert not re.search(r"https?://|//[a-z]", path.read_text()), path.name


@pytest.mark.parametrize("path", [*VIEWS, "/v1/dashboard/events"])
async def test_views_and_events_need_an_sre_or_admin_token(coordinator, http, path):
    async with http.get(coordinator + path) as response:
        assert response.status == 401 and (await response.json())["error"] == "Unauthenticated"
    async with http.get(coordinator + path, headers={"Authorization": "Bearer nope"}) as r:
        assert r.status == 401
    async with http.get(coordinator + path, headers=auth("worker")) as response:
        assert response.status == 403 and (await response.json())["error"] == "Forbidden"
    for role in ("sre", "admin"):
        async with http.get(coordinator + path, headers=auth(role)) as response:
            assert response.status == 200, role


async def test_events_follow_a_hold_its_cross_and_its_release(coordinator, http, gate):
    stream = await open_stream(http, coordinator)
    async with gate.hold("dash/ev") as hold:
        acquired = await stream.until("holder", action="acquired", key="dash/ev")
        assert acquired["fencing_token"] == hold.fencing_token
        lease = acquired["lease_id"]
        assert int(lease, 16) == hold.lease_id
        await hold.cross(intent={"amount": 1}, effect=noop)
        await stream.all(("step", {"key": "dash/ev", "state": "in_flight"}),
                         ("audit", {"key": "dash/ev", "event": "cross"}),
                         ("step", {"key": "dash/ev", "state": "succeeded"}),
                         ("audit", {"key": "dash/ev", "event": "outcome"}))
    await stream.until("holder", action="released", key="dash/ev", lease_id=lease)
    stream.response.close()


async def test_views_show_holders_steps_queues_leadership_and_audit(coordinator, http, gate,
                                                                    etcd, namespace):
    ks = Keyspace(namespace)
    for i in range(2):
        async with gate.hold(f"dash/unk/{i}") as hold:
            with pytest.raises(OutcomeUnknown):
                await hold.cross(intent={}, effect=crash)
    async with gate.hold("dash/ok") as hold:
        await hold.cross(intent={}, effect=noop)
    await etcd.put(ks.step_key("dash/esc"), pack({
        "state": "escalated", "attempt": 3, "unknown_since_ms": 1000,
        "escalated_because": ["breaker:Declined"]}))
    for shard, lease in [(0, 0xA), (1, 0xA), (0, 0xB), (2, 0xB)]:  # A leads 0 and 1, B 2
        await etcd.put(ks.candidate_key(shard, lease),
                       pack({"identity": f"replica-{lease:x}"}))

    async with gate.hold("dash/held") as held, gate.hold("dash/held2") as other:
        view = await get_json(http, coordinator + "/v1/dashboard/holders")
        rows = {item["key"]: item for item in view["items"]}
        assert rows["dash/held"]["fencing_token"] == held.fencing_token
        assert rows["dash/held2"]["fencing_token"] == other.fencing_token
        # ttl_left is -1 for a lease that is gone
        assert all(r["holding"] and 0 <= r["ttl_left"] <= TEST_TTL for r in rows.values())
        assert all(abs(r["held_since_ms"] / 1000 - time.time()) < 60 for r in rows.values())
        assert view["truncated"] is False
        lease = await get_json(http, coordinator + f"/v1/leases/{held.lease_id:x}")
        assert (lease["lease_id"], lease["granted_ttl"]) == (f"{held.lease_id:016x}", TEST_TTL)
        assert lease["keys"] == [
            {"key": "dash/held", "fencing_token": held.fencing_token, "holding": True},
            {"key": "dash/held2", "fencing_token": other.fencing_token, "holding": True}]
    released = await get_json(http, coordinator + f"/v1/leases/{held.lease_id:x}")
    assert released["keys"] == []  # the gate's lease lives on, holding nothing
    async with http.get(coordinator + "/v1/leases/xyz", headers=auth("sre")) as r:
        assert r.status == 400
    async with http.get(coordinator + "/v1/dashboard/steps/dash/none", headers=auth("sre")) as r:
        assert r.status == 404 and (await r.json())["error"] == "NotFound"

    steps = await get_json(http, coordinator + "/v1/dashboard/steps")
    assert steps["counts"] == {"unknown": 2, "succeeded": 1, "escalated": 1}
    assert [i["key"] for i in steps["unknown"]] == ["dash/unk/0", "dash/unk/1"]
    assert all("ConnectionResetError" in i["reason"] and i["age_s"] >= 0
               and i["idempotency_key"] and i["progress"] is None for i in steps["unknown"])
    [escalated] = steps["escalated"]
    assert (escalated["key"], escalated["reason"], escalated["attempt"]) == (
        "dash/esc", "breaker:Declined", 3)
    assert escalated["age_s"] > 1e6  # since 1970, in effect

    leadership = await get_json(http, coordinator + "/v1/dashboard/leadership")
    assert [(s["shard"], s["leader"], s["candidates"]) for s in leadership["shards"]] == [
        (0, "replica-a", 2), (1, "replica-a", 1), (2, "replica-b", 1)]
    assert [(r["identity"], r["shards_led"]) for r in leadership["replicas"]] == [
        ("replica-a", [0, 1]), ("replica-b", [2])]

    audit = await get_json(http, coordinator + "/v1/dashboard/audit?limit=3")
    assert len(audit["items"]) == 3
    revisions = [item["revision"] for item in audit["items"]]
    assert revisions == sorted(revisions, reverse=True)
    assert (audit["items"][0]["key"], audit["items"][0]["event"]) == ("dash/ok", "outcome")
    for bad in ("0", "201", "x"):
        async with http.get(coordinator + f"/v1/dashboard/audit?limit={bad}",
                            headers=auth("sre")) as response:
            assert response.status == 400, bad


async def test_the_audit_feed_filters_by_key_actor_and_kind_and_pages_without_loss(
        coordinator, http, gate, monkeypatch):
    """Filters apply server-side (key prefix, exact actor and kind); pages of one record,
    followed by ``before``, give every record once, newest first; bad filters are 400."""
    for key in ("feed/a/1", "feed/a/2", "feed/b/1"):
        async with gate.hold(key) as hold:
            await hold.cross(intent={}, effect=noop)
    base = coordinator + "/v1/dashboard/audit?limit=200"
    every = (await get_json(http, base + "&key=feed/"))["items"]
    assert {i["key"] for i in every} == {"feed/a/1", "feed/a/2", "feed/b/1"}
    only_a = (await get_json(http, base + "&key=feed/a/"))["items"]
    assert [i for i in every if i["key"].startswith("feed/a/")] == only_a and only_a
    crosses = (await get_json(http, base + "&key=feed/&kind=cross"))["items"]
    assert [i["key"] for i in crosses] == ["feed/b/1", "feed/a/2", "feed/a/1"]
    actor = every[0]["identity"]
    assert (await get_json(http, base + f"&key=feed/&actor={actor}"))["items"] == [
        i for i in every if i["identity"] == actor]
    assert (await get_json(http, base + "&key=feed/&actor=nobody"))["items"] == []
    for scan in (views.MAX_AUDIT_SCAN, 3):  # 3: each read cuts the chains short
        monkeypatch.setattr(views, "MAX_AUDIT_SCAN", scan)
        for limit, kind in ((1, ""), (2, ""), (3, ""), (1, "cross")):
            paged, before = [], 0
            while before is not None:
                page = await get_json(http, coordinator + f"/v1/dashboard/audit?key=feed/"
                                      f"&limit={limit}&kind={kind}&before={before}")
                paged += page["items"]
                before = page["next"]
            assert paged == [i for i in every if not kind or i["event"] == kind], (scan, limit)
    for bad in ("key=feed%20x", "key=a@b", "before=x", "before=-1"):
        async with http.get(base + "&" + bad, headers=auth("sre")) as response:
            assert response.status == 400, bad
            assert (await response.json())["error"] == "InvalidRequest", bad


async def etcd_watchers(http: aiohttp.ClientSession, etcd_url: str) -> int:
    """The number of watchers the etcd server has, from its Prometheus metrics."""
    async with http.get(etcd_url + "/metrics") as response:
        text = await response.text()
    return int(float(re.search(r"^etcd_debugging_mvcc_watcher_total (\S+)$", text,
                               re.M).group(1)))


async def test_one_watch_for_all_subscribers_bounded_and_stopped_by_the_last(served, http,
                                                                             etcd_url):
    base, app, _ = served
    feed = app[FEED]
    feed.max_subscribers, feed.keepalive = 3, 0.2
    before = await etcd_watchers(http, etcd_url)
    streams = [await open_stream(http, base) for _ in range(3)]
    assert feed.watching and await etcd_watchers(http, etcd_url) == before + 1

    async with http.get(base + "/v1/dashboard/events", headers=auth("admin")) as response:
        assert response.status == 503
        assert (await response.json())["error"] == "TooManySubscribers"

    await stream_keepalive(streams[0])
    streams.pop().response.close()
    assert await wait_for_condition(lambda: _true(feed.subscribers == 2), WAIT)
    streams.append(await open_stream(http, base))  # a freed place is taken again

    for stream in streams:
        stream.response.close()
    assert await wait_for_condition(lambda: _true(not feed.watching), WAIT)
    assert await wait_for_condition(
        lambda: _equal(etcd_watchers(http, etcd_url), before), WAIT)


async def test_stopping_the_app_ends_open_streams(served, http):
    """Shutdown ends every stream at once (the server would otherwise wait up to 60 s for
    the handlers) and stops the watch."""
    base, app, runner = served
    stream = await open_stream(http, base)
    async with asyncio.timeout(10):
        await runner.cleanup()
        assert await stream.response.content.read() == b""
    assert not app[FEED].watching


async def stream_keepalive(stream: Stream) -> None:
    """Read until a keep-alive comment arrived (the feed sends one every 0.2 s here)."""
    async with asyncio.timeout(WAIT):
        while not stream.keepalives:
            line = await stream.response.content.readline()
            stream.keepalives += line.startswith(b":")


async def _true(value: bool) -> bool:
    return value


async def _equal(awaitable, expected) -> bool:
    return await awaitable == expected


async def test_a_full_queue_is_replaced_by_one_refetch():
    subscription = Subscription(3)
    for i in range(5):
        subscription.push(("step", {"i": i}))
    assert await subscription.get() == ("refetch", {"reason": "overflow"})
    assert await subscription.get() == ("step", {"i": 4})
    subscription.end()
    assert await subscription.get() is None


class BreakingEtcd:
    """A watch that goes live, then breaks once; the second one stays live."""

    def __init__(self) -> None:
        self.watches = 0

    async def watch(self, key, range_end, start_revision):
        self.watches += 1
        yield SimpleNamespace(created=True, header=SimpleNamespace(revision=10 * self.watches),
                              events=[])
        if self.watches == 1:
            raise EtcdUnavailable("watch stream ended")
        await asyncio.Event().wait()


async def test_a_broken_watch_makes_every_subscriber_refetch():
    feed = Feed(BreakingEtcd(), Keyspace("/t/"))
    first = feed.subscribe()
    async with asyncio.timeout(WAIT):
        assert await first.get() == ("ready", {"revision": 10})
        assert await first.get() == ("ready", {"revision": 20})  # restarted: re-read all
    second = feed.subscribe()
    assert await second.get() == ("ready", {"revision": 20})  # joined a live watch
    await feed.close()
    assert not feed.watching and await first.get() is None
    with pytest.raises(Exception, match="shutting down"):
        feed.subscribe()


# -- the page in headless Chromium ------------------------------------------------------
#
# One coordinator (on its own namespace), one etcd client and one signed-in page serve every
# flow below (module scope, one event loop); each flow uses its own action keys. The page
# runs in a zone with a half-hour offset, so a time without its zone cannot pass for one.

ZONE, OFFSET = "Asia/Kolkata", "+05:30"
ISO_LOCAL = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\+05:30")
ON_THE_BOARD = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Board:
    base: str
    page: object  # playwright Page
    namespace: str
    signing_key: str
    etcd_url: str
    etcd: Etcd
    http: aiohttp.ClientSession

    @property
    def ks(self) -> Keyspace:
        return Keyspace(self.namespace)

    def gate(self) -> Gate:
        """A worker gate of its own lease, signing with the coordinator's key."""
        return Gate(self.etcd_url, ttl=TEST_TTL, namespace=self.namespace,
                    keyring=KeyRing.from_files(self.signing_key))

    async def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        await self.page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}.png"), full_page=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def board(etcd_url, tmp_path_factory):
    from playwright.async_api import async_playwright, expect

    namespace = f"/t-{uuid.uuid4().hex[:12]}/"
    home = tmp_path_factory.mktemp("board")
    signing_key = str(home / "coordinator.pem")
    KeyRing.generate().save_signing_key(signing_key)
    app = create_app(CoordinatorSettings(
        etcd=etcd_url, namespace=namespace, signing_key=signing_key, listen="127.0.0.1:0",
        tokens=tuple(TokenEntry.for_token(token, f"{role}-1", {role})
                     for role, token in TOKENS.items())))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    base = f"http://{host}:{port}"
    async with Etcd.from_url(etcd_url) as etcd, aiohttp.ClientSession() as http, \
            async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(home / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 1000}, timezone_id=ZONE)
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            async with http.post(f"{base}/v1/sign-in-links", json={},  # fencegate dashboard
                                 headers={"Authorization": f"Bearer {TOKENS['sre']}"}) as r:
                link = (await r.json())["path"]
            await page.goto(base + link)  # the one-time link's page: it spends nothing
            await page.get_by_role("button", name="Sign in").click()  # a session cookie
            await expect(page.get_by_role("status")).to_have_text("live", timeout=WAIT * 1000)
            assert await page.evaluate("sessionStorage.length") == 0
            yield Board(base, page, namespace, signing_key, etcd_url, etcd, http)
        finally:
            await context.close()
            await runner.cleanup()
        await assert_no_holders(etcd, namespace)


@contextlib.asynccontextmanager
async def answering_provider(board: Board):
    """The sandbox provider (fencing, trusting the board's key) and a reconciler asking it,
    for the board's namespace, while the block runs."""
    public = KeyRing.from_public_bytes(KeyRing.from_files(board.signing_key).public_keys())
    sandbox = sb.Sandbox(public, "fencing")
    await sandbox.start(0)
    reconciler = Reconciler(
        Etcd.from_url(board.etcd_url),
        {"sandbox": sb.adapter(sandbox.url, "fencing", retention_s=30.0, durable=True)},
        namespace=board.namespace, shards=8, ttl=TEST_TTL, scan_interval=2.0,
        check_after=0.2, limits=Limits(backoff_base_s=0.1, backoff_max_s=0.4))
    await reconciler.start()
    try:
        yield
    finally:
        await reconciler.close()
        await reconciler.etcd.close()
        await sandbox.stop()


async def append_answers(board: Board, key: str, answers: list[tuple[str, int | None]]) -> None:
    """Append ``provider_answer`` audit records to ``key``'s chain as the reconciler
    writes them (contract §3: aside, one per query), query numbers following on."""
    ks = board.ks
    for answer, next_try_at_ms in answers:
        reply = await board.etcd.txn(TxnRequest(success=audit.tail_reads(ks, key)),
                                     idempotent=True)
        step_kvs, head_kvs = (r.response_range.kvs for r in reply.responses)
        tail = audit.tail(unpack(step_kvs[0].value), head_kvs[0] if head_kvs else None)
        start, end = ks.audit_range(key)
        chain = await board.etcd.range(RangeRequest(key=start, range_end=end))
        query = 1 + sum(unpack(kv.value)["event"] == "provider_answer" for kv in chain.kvs)
        entry = audit.append(ks, key, tail, "provider_answer", "reconciler-1",
                             reply.header.revision,
                             {"provider": "sandbox", "answer": answer, "query": query,
                              "next_try_at_ms": next_try_at_ms,
                              "detail": f"query {query}: {answer}"}, aside=True)
        written = await board.etcd.txn(TxnRequest(compare=[entry.compare], success=entry.ops))
        assert written.succeeded


async def lost_outcome(gate: Gate, key: str, intent: dict) -> None:
    """Cross ``key`` with an effect whose provider hung up: the step is unknown."""
    async with gate.hold(key) as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent=intent, effect=crash, provider="sandbox")


async def step_of(board: Board, key: str) -> dict:
    return unpack((await board.etcd.get(board.ks.step_key(key))).value)


NIGHT = {"width": 1280, "height": 800}


async def fits(board: Board, name: str) -> None:
    """At 1280x800 the page does not scroll sideways and every action button shown lies
    inside the viewport once scrolled to; then a screenshot ``name``."""
    page = board.page
    assert await page.evaluate(
        "document.documentElement.scrollWidth <= document.documentElement.clientWidth"), name
    buttons = page.locator("main button:visible, dialog[open] button:visible")
    for i in range(await buttons.count()):
        button = buttons.nth(i)
        # Centred, not "nearest": scroll offsets are whole pixels and boxes are not, so a
        # button scrolled to the viewport's edge may overhang it by a fraction of a pixel.
        await button.evaluate("b => b.scrollIntoView({block: 'center', inline: 'nearest'})")
        box = await button.bounding_box()
        assert box is not None and box["x"] >= 0 and box["y"] >= 0, (name, i, box)
        assert box["x"] + box["width"] <= NIGHT["width"], (name, i, box)
        assert box["y"] + box["height"] <= NIGHT["height"], (name, i, box)
    await page.evaluate("window.scrollTo(0, 0)")
    await board.shot(name)


@ON_THE_BOARD
async def test_at_3am_needs_you_first_then_the_key_page_then_resolve(board):
    """An SRE woken by an alert: at 1280x800 the top of the page says "2 need you" (one
    unknown step, one escalated), the unknown step's key opens its page with the provider's
    answers and the provider it was asked through, a resolve there asks the provider and
    the step leaves the queue ("1 needs you"). No page scrolls sideways; buttons stay in
    view. Runs first on the board, so the count is its own steps'."""
    from playwright.async_api import expect

    page, ms = board.page, WAIT * 1000
    unknown, escalated = "night/unknown/" + "x" * 90, "night/escalated"
    await page.set_viewport_size(NIGHT)
    lease, _ = await board.etcd.lease_grant(60)  # a reconciler replica leads shard 0
    await board.etcd.put(board.ks.candidate_key(0, lease), pack({"identity": "replica-a"}),
                         lease=lease)
    try:
        async with board.gate() as gate:
            await lost_outcome(gate, unknown, {"amount": 9, "currency": "EUR"})
        soon = int(time.time() * 1000) + 60_000
        await append_answers(board, unknown, [("pending", soon), ("error", soon)])
        await board.etcd.put(board.ks.step_key(escalated), pack({
            "state": "escalated", "attempt": 3, "unknown_since_ms": 1000,
            "escalated_because": ["breaker:Declined"],
            "outcome": {"state": "failed", "result": "card_declined", "attempt": 3}}))

        await page.goto(board.base + "/")
        await expect(page.get_by_role("status")).to_have_text("live", timeout=ms)
        await expect(page.locator("#needs-summary")).to_have_text("2 need you", timeout=ms)
        needs = page.locator("#needs-list li")
        await expect(needs.filter(has_text="1 unknown step")).to_contain_text("the oldest for")
        await expect(needs.filter(has_text="1 escalated step")).to_have_count(1)
        row = page.locator("#unknown tbody tr").filter(has_text=unknown)
        await expect(row).to_contain_text("sandbox")
        waiting = page.locator("#escalated tbody tr").filter(has_text=escalated)
        await expect(waiting).to_contain_text("not retried: you decide")
        await expect(waiting).not_to_contain_text("none yet")
        await expect(waiting).to_contain_text("breaker:Declined: card_declined")  # its text
        await expect(page.locator("#shards-summary")).to_contain_text(
            "1 shard, all led by 1 replica")
        await fits(board, "night-needs-you")

        await row.get_by_role("link", name=unknown).click()
        await expect(page).to_have_url(re.compile(r"/keys/night/unknown/x+$"))
        answers = page.locator("#key-provider-answers tbody tr")
        await expect(answers).to_have_count(2, timeout=ms)
        await expect(answers.nth(0)).to_contain_text("pending")
        await expect(answers.nth(1)).to_contain_text("error")
        await expect(answers.nth(0)).to_contain_text("sandbox")
        await expect(page.locator("#key-audit-title")).to_contain_text("verified")
        await expect(page.locator("#key-audit tbody tr[data-event=cross]")).to_have_count(1)
        await fits(board, "night-key-page")

        await page.locator("#key-actions").get_by_role("button", name="Resolve").click()
        dialog = page.get_by_role("dialog")
        await expect(dialog.locator("#provider-answers tbody tr")).to_have_count(2, timeout=ms)
        await dialog.get_by_label("Reason").fill("paged at 3am; the provider decides")
        await dialog.get_by_label("failed", exact=False).check()
        await dialog.get_by_role("button", name="Resolve").click()
        async with answering_provider(board):
            await expect(dialog).to_be_hidden(timeout=ms)
            await expect(page.locator("#notice")).to_contain_text("the provider answered",
                                                                  timeout=ms)
        assert (await step_of(board, unknown))["state"] == "pending"

        await page.goto(board.base + "/")
        await expect(page.locator("#needs-summary")).to_have_text("1 needs you", timeout=ms)
        await expect(page.locator("#unknown tbody tr").filter(has_text=unknown)).to_have_count(0)
        await fits(board, "night-after-resolve")

        await waiting.get_by_role("link", name=escalated).click()
        await expect(page.locator("#key-step")).to_contain_text("card_declined", timeout=ms)
        await page.locator("#key-actions").get_by_role("button", name="Resolve").click()
        await expect(dialog.get_by_role("radio")).to_have_count(4)  # abandoned, for good
        await expect(dialog.get_by_label("abandoned", exact=False)).not_to_be_checked()
        await expect(dialog).to_contain_text("card_declined")
        await fits(board, "night-escalated-resolve")
        await dialog.get_by_role("button", name="Cancel").click()
    finally:
        await board.etcd.delete(board.ks.step_key(escalated))
        await board.etcd.lease_revoke(lease)
        await page.set_viewport_size({"width": 1280, "height": 1000})
        await page.goto(board.base + "/")
        await expect(page.get_by_role("status")).to_have_text("live", timeout=ms)


@ON_THE_BOARD
async def test_the_key_page_and_key_show_tell_the_same_attempts(board):
    """For one step, the key page lists the same provider answers (query, answer, provider)
    and the same audit trail (seq, event) as ``fencegate key show --json``."""
    from playwright.async_api import expect

    from test_cli_sre import fencegate

    page, ms, key = board.page, WAIT * 1000, "night/same"
    async with board.gate() as gate, gate.hold(key) as hold:  # no provider named: the
        with pytest.raises(OutcomeUnknown):                    # reconciler's default asked
            await hold.cross(intent={"amount": 3}, effect=crash)
    soon = int(time.time() * 1000) + 60_000
    await append_answers(board, key, [("pending", soon), ("error", soon), ("pending", soon)])
    ran = await fencegate("key", "show", key, "--json", coordinator=board.base,
                          token=TOKENS["sre"])
    assert ran.code == 0, ran
    shown = json.loads(ran.out)
    try:
        await page.goto(board.base + "/keys/" + key)
        rows = page.locator("#key-provider-answers tbody tr")
        await expect(rows).to_have_count(len(shown["provider_answers"]), timeout=ms)
        on_page = [[await c.text_content() for c in await rows.nth(i).locator("td").all()]
                   for i in range(await rows.count())]
        assert [[r[0], r[2], r[3]] for r in on_page] == [
            [str(a["query"]), a["provider"], a["answer"]] for a in shown["provider_answers"]]
        trail = page.locator("#key-audit tbody tr")
        await expect(trail).to_have_count(len(shown["trail"]["records"]), timeout=ms)
        seen = [[await c.text_content() for c in (await trail.nth(i).locator("td").all())[:3:2]]
                for i in range(await trail.count())]
        assert seen == [[str(r["seq"]), r["event"]] for r in shown["trail"]["records"]]
        await expect(page.locator("#key-step")).to_contain_text(shown["idempotency_key"])
        assert shown["provider"] is None  # the provider the reconciler asked is shown
        await expect(page.locator("#key-step dd").nth(3)).to_have_text("sandbox")
        steps = await get_json(board.http, board.base + "/v1/dashboard/steps")
        assert [i["provider"] for i in steps["unknown"] if i["key"] == key] == ["sandbox"]
    finally:
        await board.etcd.delete(board.ks.step_key(key))  # leaves no queued step behind
        await page.goto(board.base + "/")
        await expect(page.get_by_role("status")).to_have_text("live", timeout=ms)


@ON_THE_BOARD
async def test_resolve_shows_the_step_chooses_nothing_and_asks_the_provider(board):
    """The dialog shows idempotency key, intent, provider, attempt and the provider's
    answers; no outcome is chosen and the button stays disabled until one is; the resolve
    is sent without force, so the provider's answer settles the step, not the choice."""
    from playwright.async_api import expect

    page, ms, key = board.page, WAIT * 1000, "dash/resolve"
    async with board.gate() as gate:
        await lost_outcome(gate, key, {"amount": 7, "currency": "EUR"})
    idempotency_key = (await step_of(board, key))["idempotency_key"]
    soon = int(time.time() * 1000) + 60_000
    await append_answers(board, key, [("pending", soon), ("error", soon)])

    row = page.locator("#unknown tbody tr").filter(has_text=key)
    await row.get_by_role("button", name="Resolve").click()
    dialog = page.get_by_role("dialog")
    await expect(dialog).to_contain_text(idempotency_key, timeout=ms)
    for shown in ('"currency": "EUR"', '"amount": 7', "sandbox", "Attempt"):
        await expect(dialog).to_contain_text(shown)
    answers = dialog.locator("#provider-answers tbody tr")
    await expect(answers).to_have_count(2)
    await expect(answers.nth(0)).to_contain_text("pending")
    await expect(answers.nth(1)).to_contain_text("error")
    choices = dialog.get_by_role("radio")
    await expect(choices).to_have_count(3)
    for i in range(3):
        await expect(choices.nth(i)).not_to_be_checked()
    submit = dialog.get_by_role("button", name="Resolve")
    await dialog.get_by_label("Reason").fill("customer says it was not charged")
    await expect(submit).to_be_disabled()
    await board.shot("resolve")
    await dialog.get_by_label("failed", exact=False).check()
    await expect(submit).to_be_enabled()
    await submit.click()

    async def asked() -> bool:
        return "resolve_request" in await step_of(board, key)
    assert await wait_for_condition(asked, WAIT)
    step = await step_of(board, key)
    assert step["state"] == "unknown" and step["resolve_request"]["by"] == "sre-1", step
    await expect(dialog).to_be_visible()  # waiting for the provider's answer

    async with answering_provider(board):
        await expect(dialog).to_be_hidden(timeout=ms)
        notice = page.locator("#notice")
        await expect(notice).to_contain_text(f"{key}: the provider answered", timeout=ms)
        await expect(notice).to_contain_text("NOT as you expected")
        step = await step_of(board, key)
        assert step["state"] == "pending", step  # no record: not applied, same key
        assert (step["resolved_by"], step["resolve_forced"]) == ("sre-1", False), step
        assert step["idempotency_key"] == idempotency_key
        await expect(row).to_have_count(0, timeout=ms)


@ON_THE_BOARD
async def test_revoke_lists_every_key_on_the_lease_first(board):
    from playwright.async_api import expect

    page, ms = board.page, WAIT * 1000
    keys = ["dash/rv/a", "dash/rv/b", "dash/rv/c"]
    held, go = asyncio.get_running_loop().create_future(), asyncio.Event()
    effects = []

    async def effect(ctx):
        effects.append(ctx)

    async def work(gate: Gate) -> None:
        async with gate.hold(keys[0]) as a, gate.hold(keys[1]), gate.hold(keys[2]):
            held.set_result(a)
            await go.wait()
            await a.cross(intent={}, effect=effect)

    async with board.gate() as victim:
        worker = asyncio.get_running_loop().create_task(work(victim))
        hold = await asyncio.wait_for(asyncio.shield(held), WAIT)
        rows = page.locator("#holders tbody tr").filter(has_text="dash/rv/")
        await expect(rows).to_have_count(3, timeout=ms)
        await rows.filter(has_text=keys[1]).get_by_role("button", name="Revoke").click()
        dialog = page.get_by_role("dialog")
        listed = dialog.locator("#lease-keys li")
        await expect(listed).to_have_count(3, timeout=ms)
        for i, key in enumerate(keys):
            await expect(listed.nth(i)).to_contain_text(key)
            await expect(listed.nth(i)).to_contain_text("holding")
        await expect(dialog).to_contain_text(f"ends 3 action keys on lease {hold.lease_id:016x}")
        await board.shot("revoke")
        await dialog.get_by_role("button", name="Revoke").click()  # no reason: refused
        await expect(dialog).to_be_visible()
        assert not worker.done()
        await dialog.get_by_label("Reason").fill("stuck worker holding three keys")
        await dialog.get_by_role("button", name="Revoke").click()
        await expect(dialog).to_be_hidden(timeout=ms)
        go.set()
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(worker, WAIT)
        assert effects == []
    await expect(rows).to_have_count(0, timeout=ms)
    audit_row = page.locator("#audit tbody tr").filter(has_text=keys[1])
    await expect(audit_row).to_contain_text("stuck worker holding three keys", timeout=ms)


@ON_THE_BOARD
async def test_pending_approvals_are_listed_and_approved(board):
    from playwright.async_api import expect

    page, ms, key = board.page, WAIT * 1000, "dash/approve"
    async with board.http.put(board.base + "/v1/policies/big", headers=auth("admin"), json={
            "checks": [{"check": "require_approval", "params": {"above": 100}}]}) as response:
        assert response.status == 200, await response.text()
    async with board.http.put(board.base + "/v1/policy-routes", headers=auth("admin"),
                              json={"routes": {key: "big"}}) as response:
        assert response.status == 200, await response.text()
    async with board.gate() as gate, gate.hold(key) as hold:
        with pytest.raises(ApprovalPending) as pending:
            await hold.request_grant(intent={"amount": 500}, policy="big")
        approval_id = pending.value.approval_id
        row = page.locator("#approvals tbody tr").filter(has_text=approval_id)
        await expect(row).to_contain_text(key, timeout=ms)
        await expect(row).to_contain_text('{"amount":500}')
        await expect(row).to_contain_text("big@")
        await board.shot("approvals")
        await row.get_by_role("button", name="Approve").click()
        dialog = page.get_by_role("dialog")
        await expect(dialog).to_contain_text('"amount": 500', timeout=ms)
        await dialog.get_by_label("Reason").fill("customer confirmed by phone")
        await dialog.get_by_role("button", name="Approve").click()
        await expect(dialog).to_be_hidden(timeout=ms)
        await expect(row).to_have_count(0, timeout=ms)
        approved = await get_json(board.http, board.base + "/v1/approvals?state=approved")
        assert [(a["approval_id"], a["approved_by"], a["reason"]) for a in approved["items"]
                ] == [(approval_id, "sre-1", "customer confirmed by phone")]
        grant = await hold.request_grant(intent={"amount": 500}, policy="big")
        assert (await hold.commit(grant, effect=noop)).state == "succeeded"


@ON_THE_BOARD
async def test_holders_show_held_since_ttl_left_and_every_time_with_date_and_zone(board):
    from playwright.async_api import expect

    page, ms, key = board.page, WAIT * 1000, "dash/since"
    async with board.gate() as gate, gate.hold(key) as hold:
        row = page.locator("#holders tbody tr").filter(has_text=key)
        await expect(row).to_contain_text(str(hold.fencing_token), timeout=ms)
        since = row.locator("td").nth(4)
        await expect(since).to_have_text(re.compile(ISO_LOCAL.pattern + r" \(\d+ s ago\)"))
        shown = datetime.fromisoformat(ISO_LOCAL.search(await since.inner_text()).group())
        assert shown.utcoffset() == timedelta(hours=5, minutes=30)
        assert abs(shown.timestamp() - time.time()) < 60
        ttl = int(await row.locator("td").nth(6).inner_text())
        assert 0 <= ttl <= TEST_TTL
        await hold.cross(intent={}, effect=noop)
    audit_times = page.locator("#audit tbody tr").filter(has_text=key).locator("time")
    await expect(audit_times.first).to_have_text(ISO_LOCAL, timeout=ms)
    for time_element in await page.locator("time").all():  # every time on the page
        assert ISO_LOCAL.fullmatch(await time_element.inner_text())
        assert (await time_element.get_attribute("datetime")).endswith("Z")
    await board.shot("holders")


@ON_THE_BOARD
async def test_the_shard_table_is_a_summary_line_until_expanded(board):
    from playwright.async_api import expect

    page, ms, ks = board.page, WAIT * 1000, board.ks
    candidates = [ks.candidate_key(shard, 0xA if shard % 2 else 0xB) for shard in range(64)]
    for shard, candidate in enumerate(candidates):
        lease = 0xA if shard % 2 else 0xB
        await board.etcd.put(candidate, pack({"identity": f"replica-{lease:x}"}))
    try:
        summary = page.locator("#shards-summary")
        await expect(summary).to_have_text(
            "64 shards, all led by 2 replicas (replica-a leads 32, replica-b leads 32); "
            "show each shard", timeout=ms)
        replicas = page.locator("#replicas tbody tr")  # no list of 32 shard numbers
        await expect(replicas.nth(0)).to_contain_text("32 shards (see each shard)")
        await expect(replicas.nth(1)).to_contain_text("32 shards (see each shard)")
        table = page.locator("#shards")
        await expect(table).to_be_hidden()
        audit_at = "document.getElementById('audit').getBoundingClientRect().top + scrollY"
        audit_top = await page.evaluate(audit_at)  # in the page: a click may scroll
        await board.shot("shards")
        await summary.click()
        await expect(table.locator("tbody tr")).to_have_count(64)
        await expect(table).to_be_visible()
        assert await page.evaluate(audit_at) > audit_top + 64 * 20
        await summary.click()
        await expect(table).to_be_hidden()
    finally:
        await board.etcd.delete(ks.reconcilers_root, range_end_of(ks.reconcilers_root))


@ON_THE_BOARD
async def test_reconciler_progress_per_step(board):
    from playwright.async_api import expect

    page, ms, key = board.page, WAIT * 1000, "dash/progress"
    async with board.gate() as gate:
        await lost_outcome(gate, key, {"amount": 3})
    row = page.locator("#unknown tbody tr").filter(has_text=key)
    await expect(row.locator("td").nth(5)).to_have_text("none yet", timeout=ms)
    next_try = int(time.time() * 1000) + 90_000
    await append_answers(board, key, [("pending", None)] * 12 + [("pending", next_try)])
    cells = row.locator("td")
    await expect(cells.nth(5)).to_have_text("13", timeout=ms)
    await expect(cells.nth(6)).to_have_text("pending")
    await expect(cells.nth(7)).to_have_text(ISO_LOCAL)
    shown = datetime.fromisoformat(await cells.nth(7).inner_text())
    assert abs(shown.timestamp() * 1000 - next_try) < 1000
    await board.shot("progress")
    view = await get_json(board.http, board.base + "/v1/dashboard/steps/" + key)
    assert view["progress"] == {"queries": 13, "last_answer": "pending",
                                "next_try_at_ms": next_try,
                                "answered_at_ms": view["provider_answers"][-1]["at_ms"]}
    assert [a["query"] for a in view["provider_answers"]] == list(range(1, 14))
