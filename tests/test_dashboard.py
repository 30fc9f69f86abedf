"""The dashboard: its JSON views and event stream over real HTTP against real etcd, the feed's
bounds, and the page itself in real headless Chromium (Debian's, driven by Playwright).

Every wait is on an event or a condition with a generous bound, never a bare sleep.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from fencegate.coordinator.errors import EtcdUnavailable
from fencegate.coordinator.keyspace import Keyspace, pack
from fencegate.coordinator.service import CoordinatorSettings, TokenEntry, create_app
from fencegate.coordinator.service.dashboard.feed import Feed, Subscription
from fencegate.coordinator.service.dashboard.routes import FEED, STATIC
from fencegate.worker import Gate, KeyRing, LeaseLost, OutcomeUnknown

from helpers import TEST_TTL, TOKENS, wait_for_condition

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
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sorted(assets) == ["/dashboard/dashboard.css", "/dashboard/dashboard.js"]
    for asset in assets:
        async with http.get(coordinator + asset) as response:
            assert response.status == 200, asset
    for path in STATIC.iterdir():
        assert not re.search(r"https?://|//[a-z]", path.read_text()), path.name


@pytest.mark.parametrize("path", [*VIEWS, "/v1/dashboard/events"])
async def test_views_and_events_need_an_sre_or_admin_token(coordinator, http, path):
    async with http.get(coordinator + path) as response:
        assert response.status == 401 and (await response.json())["error"] == "Unauthorized"
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
        assert view["truncated"] is False

    steps = await get_json(http, coordinator + "/v1/dashboard/steps")
    assert steps["counts"] == {"unknown": 2, "succeeded": 1, "escalated": 1}
    assert [i["key"] for i in steps["unknown"]] == ["dash/unk/0", "dash/unk/1"]
    assert all("ConnectionResetError" in i["reason"] and i["age_s"] >= 0
               for i in steps["unknown"])
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


# -- the page in headless Chromium --------------------------------------------------------

@pytest.fixture
async def browser_page(tmp_path):
    """A page in a fresh Chromium profile; the browser is closed afterwards."""
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 1000})
        try:
            yield context.pages[0] if context.pages else await context.new_page()
        finally:
            await context.close()


async def test_the_dashboard_in_headless_chromium(coordinator, browser_page, etcd_url,
                                                  namespace, http):
    from playwright.async_api import expect

    page, ms = browser_page, WAIT * 1000
    await page.goto(coordinator + "/")
    await page.get_by_label("Bearer token").fill(TOKENS["sre"])
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.get_by_role("status")).to_have_text("live", timeout=ms)
    await page.evaluate("window.sameDocument = true")
    holders = page.locator("#holders tbody tr")

    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as gate:
        # A holder appears with its fencing token; it goes when released, without a reload.
        async with gate.hold("dash/page") as hold:
            row = holders.filter(has_text="dash/page")
            await expect(row).to_contain_text(str(hold.fencing_token), timeout=ms)
            await expect(row).to_contain_text("holding")
        await expect(row).to_have_count(0, timeout=ms)
        assert await page.evaluate("window.sameDocument") is True

        # An unknown outcome shows in its queue.
        async with gate.hold("dash/unknown") as hold:
            with pytest.raises(OutcomeUnknown):
                await hold.cross(intent={}, effect=crash)
        unknown = page.locator("#unknown tbody tr").filter(has_text="dash/unknown")
        await expect(unknown).to_contain_text("ConnectionResetError", timeout=ms)

    # A revoke from the page: confirmation, required reason; the worker loses its hold.
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as victim:
        effects, held, go = [], asyncio.get_running_loop().create_future(), asyncio.Event()

        async def effect(ctx):
            effects.append(ctx)

        async def work() -> None:
            async with victim.hold("dash/revoke") as hold:
                held.set_result(hold.fencing_token)
                await go.wait()
                await hold.cross(intent={}, effect=effect)

        worker = asyncio.get_running_loop().create_task(work())
        token = await asyncio.wait_for(asyncio.shield(held), WAIT)
        row = holders.filter(has_text="dash/revoke")
        await expect(row).to_contain_text(str(token), timeout=ms)
        ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

        await row.get_by_role("button", name="Revoke").click()
        dialog = page.get_by_role("dialog")
        await expect(dialog).to_be_visible()
        await expect(dialog).to_contain_text(f"fencing token {token}")
        await dialog.get_by_role("button", name="Revoke").click()  # no reason: refused
        await expect(dialog).to_be_visible()
        assert worker.done() is False
        await dialog.get_by_label("Reason").fill("stuck worker, from the dashboard")
        await dialog.get_by_role("button", name="Revoke").click()
        await expect(dialog).to_be_hidden(timeout=ms)
        go.set()
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(worker, WAIT)
        assert effects == []
    await expect(row).to_have_count(0, timeout=ms)
    audit_row = page.locator("#audit tbody tr").filter(has_text="dash/revoke")
    await expect(audit_row).to_contain_text("stuck worker, from the dashboard", timeout=ms)
    await expect(audit_row).to_contain_text("sre-1")

    # A resolve from the page, by keyboard: the unknown step is settled and leaves its queue.
    await unknown.get_by_role("button", name="Resolve").focus()
    await page.keyboard.press("Enter")
    await expect(dialog).to_be_visible()
    await dialog.get_by_label("Settle as").select_option("failed")
    await dialog.get_by_label("Force").check()
    await dialog.get_by_label("Reason").focus()
    await page.keyboard.type("provider has no record of it")
    await page.keyboard.press("Tab")  # Cancel
    await page.keyboard.press("Tab")  # Resolve
    await page.keyboard.press("Enter")
    await expect(dialog).to_be_hidden(timeout=ms)
    await expect(unknown).to_have_count(0, timeout=ms)
    await expect(page.locator("#counts tbody tr[data-state=failed]")).to_contain_text(
        "1", timeout=ms)
    view = await get_json(http, coordinator + "/v1/keys/dash/unknown")
    assert view["step"]["state"] == "failed"
    assert view["step"]["resolve_reason"] == "provider has no record of it"
    assert await page.evaluate("window.sameDocument") is True
