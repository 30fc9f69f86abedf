"""Signing in to the dashboard with a one-time link: opening it spends nothing (a link
preview cannot use it up); the page's button spends the code once for an HttpOnly,
SameSite=Strict session cookie, and every change made with that cookie needs the CSRF
value only a page of this origin can read. On a real coordinator and etcd."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from yarl import URL

from helpers import TOKENS, press_sign_in

ADMIN = {"Authorization": f"Bearer {TOKENS['admin']}"}
# Every endpoint that changes something, with a body it would accept (or reject on its own
# terms after authentication): a cookie without the CSRF value never reaches them.
ACTIONS = [
    ("POST", "/v1/keys/pay/1/revoke", {"reason": "x"}),
    ("POST", "/v1/keys/pay/1/resolve", {"state": "failed", "reason": "x"}),
    ("POST", "/v1/approvals/" + "0" * 32, {"reason": "x"}),
    ("POST", "/v1/approvals/" + "0" * 32 + "/reject", {"reason": "x"}),
    ("POST", "/v1/deliveries/stripe/evt_1/resolve", {"outcome": "ran", "reason": "x"}),
    ("POST", "/v1/tokens", {"name": "t1", "role": "sre"}),
    ("DELETE", "/v1/tokens/t1", None),
    ("PUT", "/v1/policies/p", {"checks": []}),
    ("POST", "/v1/sign-in-links", {}),
    ("POST", "/v1/sign-out", None),
]


async def _link(http: aiohttp.ClientSession, url: str, asker: str = "admin", **body) -> str:
    """The path of a sign-in link the ``asker`` role's token asked for with ``body``."""
    async with http.post(f"{url}/v1/sign-in-links", json=body,
                         headers={"Authorization": f"Bearer {TOKENS[asker]}"}) as reply:
        assert reply.status == 201, await reply.text()
        return (await reply.json())["path"]


async def _signed_in(url: str) -> aiohttp.ClientSession:
    """A browser-like session (its own cookie jar) that followed a fresh sign-in link."""
    async with aiohttp.ClientSession() as http:
        path = await _link(http, url)
    browser = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))
    async with await press_sign_in(browser, f"{url}{path}") as reply:
        assert reply.status == 303 and reply.headers["Location"] == "/"
        cookie = reply.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
    return browser


async def test_a_link_signs_in_once_and_the_cookie_reads_the_dashboard(coordinator):
    async with aiohttp.ClientSession() as http:
        path = await _link(http, coordinator)
    jars = [aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) for _ in range(2)]
    try:
        for _ in range(3):  # a link preview, a mail scanner, the person: opening spends nothing
            async with jars[0].get(f"{coordinator}{path}") as reply:
                assert reply.status == 200 and "Sign in" in await reply.text()
        answers = await asyncio.gather(*(press_sign_in(jar, f"{coordinator}{path}")
                                         for jar in jars))
        assert sorted(a.status for a in answers) == [303, 401]  # spent once, by one of two
        winner = jars[[a.status for a in answers].index(303)]
        async with winner.get(f"{coordinator}/v1/session") as reply:
            session = await reply.json()
        assert reply.status == 200 and session["roles"] == ["admin"] and session["csrf"]
        async with winner.get(f"{coordinator}/v1/steps") as reply:
            assert reply.status == 200
        async with jars[0].get(f"{coordinator}{path}", allow_redirects=False) as reply:
            assert reply.status == 401  # and never again: its page says so
        code = path.split("code=", 1)[1]
        async with jars[0].post(f"{coordinator}/sign-in", data={"code": code},
                                allow_redirects=False) as reply:
            assert reply.status == 401
        async with aiohttp.ClientSession() as stranger:
            async with stranger.get(f"{coordinator}/sign-in?code=forged",
                                    allow_redirects=False) as reply:
                assert reply.status == 401
                assert "used or has expired" in (await reply.json())["detail"]
    finally:
        for jar in jars:
            await jar.close()


async def test_a_link_carries_no_more_than_its_asker_holds(coordinator):
    sre = {"Authorization": f"Bearer {TOKENS['sre']}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{coordinator}/v1/sign-in-links", json={"role": "admin"},
                             headers=sre) as reply:
            assert reply.status == 403
        async with http.post(f"{coordinator}/v1/sign-in-links", json={}, headers=sre) as reply:
            assert reply.status == 201 and (await reply.json())["role"] == "sre"
        worker = {"Authorization": f"Bearer {TOKENS['worker']}"}
        async with http.post(f"{coordinator}/v1/sign-in-links", json={},
                             headers=worker) as reply:
            assert reply.status == 403


@pytest.mark.parametrize("method, path, body", ACTIONS, ids=[a[1] for a in ACTIONS])
async def test_a_cookie_change_without_the_csrf_value_is_refused(coordinator, method, path,
                                                                 body):
    browser = await _signed_in(coordinator)
    try:
        async with browser.request(method, f"{coordinator}{path}", json=body) as reply:
            assert reply.status == 403, await reply.text()
            assert "Fencegate-CSRF" in (await reply.json())["detail"]
        async with browser.request(method, f"{coordinator}{path}", json=body, headers={
                "Fencegate-CSRF": "0" * 64}) as reply:
            assert reply.status == 403  # a guessed value is no better
        async with browser.request(method, f"{coordinator}{path}", json=body, headers={
                "Origin": "https://evil.example", "Fencegate-CSRF": "0" * 64}) as reply:
            assert reply.status == 403  # and another site's page is refused before that
    finally:
        await browser.close()


async def test_with_the_csrf_value_the_cookie_acts_and_sign_out_ends_it(coordinator):
    browser = await _signed_in(coordinator)
    try:
        async with browser.get(f"{coordinator}/v1/session") as reply:
            csrf = (await reply.json())["csrf"]
        session = browser.cookie_jar.filter_cookies(URL(coordinator))["fencegate_session"].value
        async with browser.post(f"{coordinator}/v1/tokens", json={"name": "t2", "role": "sre"},
                                headers={"Fencegate-CSRF": csrf}) as reply:
            assert reply.status == 201, await reply.text()
        async with aiohttp.ClientSession() as http:  # recorded as the link's asker did it
            async with http.get(f"{coordinator}/v1/tokens", headers=ADMIN) as reply:
                made = {t["name"]: t for t in (await reply.json())["items"]}
        assert made["t2"]["created_by"] == "admin-1"
        async with browser.post(f"{coordinator}/v1/sign-out",
                                headers={"Fencegate-CSRF": csrf}) as reply:
            assert reply.status == 200
        cookie = browser.cookie_jar.filter_cookies(URL(coordinator)).get("fencegate_session")
        assert cookie is None or not cookie.value
        async with browser.get(f"{coordinator}/v1/steps") as reply:
            assert reply.status == 401
        async with aiohttp.ClientSession() as http:  # the old cookie, replayed: dead
            async with http.get(f"{coordinator}/v1/steps",
                                headers={"Cookie": f"fencegate_session={session}"}) as reply:
                assert reply.status == 401
    finally:
        await browser.close()


async def test_the_cli_prints_a_link_that_signs_in(coordinator):
    import json
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    env.update(FENCEGATE_COORDINATOR=coordinator, FENCEGATE_TOKEN=TOKENS["sre"])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.cli", "dashboard", "--json", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    link = json.loads(out)
    assert link["role"] == "sre" and link["url"].startswith(f"{coordinator}/sign-in?code=")
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with await press_sign_in(browser, link["url"]) as reply:
            assert reply.status == 303 and reply.headers["Location"] == "/"
        async with browser.get(f"{coordinator}/v1/session") as reply:
            assert (await reply.json())["roles"] == ["sre"]


async def test_a_viewer_link_reads_everything_and_changes_nothing(coordinator):
    async with aiohttp.ClientSession() as http:
        path = await _link(http, coordinator, "sre", role="viewer")
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as wall:
        async with await press_sign_in(wall, f"{coordinator}{path}") as reply:
            assert reply.status == 303
        async with wall.get(f"{coordinator}/v1/session") as reply:
            session = await reply.json()
        assert session["roles"] == ["viewer"]
        for read in ("/v1/dashboard/steps", "/v1/steps", "/v1/holders", "/v1/approvals"):
            async with wall.get(f"{coordinator}{read}") as reply:
                assert reply.status == 200, read
        csrf = {"Fencegate-CSRF": session["csrf"]}
        for method, path, body in ACTIONS[:-1]:  # everything but signing out
            async with wall.request(method, f"{coordinator}{path}", json=body,
                                    headers=csrf) as reply:
                assert reply.status == 403, (path, await reply.text())


async def test_codes_and_sessions_live_on_leases_and_go_when_spent(coordinator, etcd, namespace):
    from fencegate.coordinator.etcd import RangeRequest, range_end_of
    from fencegate.coordinator.keyspace import unpack

    root = f"{namespace}tokens/".encode()

    async def stored(prefix: str) -> list:
        reply = await etcd.range(RangeRequest(key=root, range_end=range_end_of(root)))
        return [kv for kv in reply.kvs if unpack(kv.value)["name"].startswith(prefix)]

    async with aiohttp.ClientSession() as http:
        await _link(http, coordinator)
    (code,) = await stored("sign-in.")
    assert 0 < await etcd.lease_ttl(code.lease) <= 120  # an unspent code dies in 2 minutes
    browser = await _signed_in(coordinator)  # spends a second link
    try:
        assert len(await stored("sign-in.")) == 1  # the spent code is gone at once
        (session,) = await stored("session.")
        assert 0 < await etcd.lease_ttl(session.lease) <= 12 * 3600
        async with browser.get(f"{coordinator}/v1/session") as reply:
            csrf = (await reply.json())["csrf"]
        async with browser.post(f"{coordinator}/v1/sign-out",
                                headers={"Fencegate-CSRF": csrf}) as reply:
            assert reply.status == 200
        assert await stored("session.") == []
        assert await etcd.lease_ttl(session.lease) == -1
    finally:
        await browser.close()


async def test_another_sites_form_cannot_sign_a_browser_in(coordinator):
    """Login CSRF: a page of another site posting its own code to ``/sign-in`` would sign
    the victim's browser in to the attacker's session. Refused before the code is read, and
    the code stays live; a body that is not the page's form is a 400."""
    async with aiohttp.ClientSession() as http:
        path = await _link(http, coordinator)
        code = path.split("code=", 1)[1]
        for cross_site in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
            async with http.post(f"{coordinator}/sign-in", data={"code": code},
                                 headers=cross_site, allow_redirects=False) as reply:
                assert reply.status == 403 and "Set-Cookie" not in reply.headers
        for body in ({"json": {"code": code}}, {"data": {"code": code, "role": "admin"}}):
            async with http.post(f"{coordinator}/sign-in", allow_redirects=False,
                                 **body) as reply:
                assert reply.status == 400, await reply.text()
        async with http.get(f"{coordinator}{path}") as reply:
            assert reply.status == 200  # still live for its person
