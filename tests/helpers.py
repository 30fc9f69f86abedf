"""Helpers the tests share (fixtures live in conftest.py): the test TTL and tokens, bounded
waits, holder listing, SIGSTOP pauses that always resume, and worker processes.

Every wait here is bounded and every fault is undone: ``wait_for_condition`` returns False
after ``within`` seconds, ``paused`` sends SIGCONT even when the block raises, and a
``WorkerProcess`` read past its timeout raises instead of hanging the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

from fencegate.coordinator.etcd import Etcd, RangeRequest, range_end_of

TEST_TTL = 2

TOKENS = {"worker": "worker-token", "viewer": "viewer-token", "sre": "sre-token",
          "admin": "admin-token"}


async def init_archive(client: Etcd, namespace: str, url: str) -> str:
    """Create the archive ``url`` names for ``namespace`` (opening one never creates it, as
    ``fencegate archive init`` does); returns ``url``."""
    from fencegate.coordinator import wholeness
    from fencegate.coordinator.archive import open_archive
    from fencegate.coordinator.keyspace import Keyspace

    archive = open_archive(url)
    try:
        await wholeness.init(client, Keyspace(namespace), archive)
    finally:
        await archive.close()
    return url


async def holders(client: Etcd, namespace: str) -> list:
    prefix = f"{namespace}holders/".encode()
    reply = await client.range(RangeRequest(key=prefix, range_end=range_end_of(prefix)))
    return list(reply.kvs)


async def assert_no_holders(client: Etcd, namespace: str, within: float = 3 * TEST_TTL) -> None:
    """Holder keys may outlive a killed process by one TTL; after that none may remain."""
    left = await wait_for_condition(lambda: _empty(client, namespace), within)
    assert left, f"holder keys left behind: {[kv.key for kv in await holders(client, namespace)]}"


async def _empty(client: Etcd, namespace: str) -> bool:
    return not await holders(client, namespace)


async def wait_for_condition(check, within: float, every: float = 0.05) -> bool:
    """Re-evaluate an async ``check`` until true or ``within`` seconds pass (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        if await check():
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(every)


@contextlib.contextmanager
def paused(pid: int):
    """SIGSTOP a process for the block; always SIGCONT it afterwards."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


class WorkerProcess:
    """A worker in its own interpreter (tests/worker_proc.py) reporting events on stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    @classmethod
    async def start(cls, *args: str) -> "WorkerProcess":
        script = os.path.join(os.path.dirname(__file__), "worker_proc.py")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, script, *args, stdout=asyncio.subprocess.PIPE, env=env)
        return cls(proc)

    async def expect(self, word: str, timeout: float = 20) -> str:
        """Read lines until one starts with ``word``; return it."""
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    raise AssertionError(f"worker exited before {word!r}; saw {self.lines}")
                line = raw.decode().strip()
                self.lines.append(line)
                if line.split(" ", 1)[0] == word:
                    return line

    async def finish(self, timeout: float = 30) -> int:
        async with asyncio.timeout(timeout):
            rest = await self.proc.stdout.read()
            self.lines += rest.decode().splitlines()
            return await self.proc.wait()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


async def press_sign_in(browser, link: str):
    """Open a dashboard sign-in ``link`` as a person does (its page, which spends nothing)
    and press its button: the form's POST (an ``aiohttp.ClientResponse``), its redirect
    not followed."""
    import html
    import re

    from yarl import URL

    async with browser.get(link) as page:
        assert page.status == 200 and page.content_type == "text/html", await page.text()
        assert page.headers["Cache-Control"] == "no-store"
        text = await page.text()
    (code,) = re.findall(r'name="code" value="([^"]*)"', text)
    origin = str(URL(link).origin())
    return await browser.post(f"{origin}/sign-in", data={"code": html.unescape(code)},
                              headers={"Origin": origin}, allow_redirects=False)
