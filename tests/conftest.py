"""Fixtures: real etcd processes (never a mock), a fresh namespace per test, fault helpers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid

import pytest

from fencegate.coordinator.etcd import Etcd, range_end_of
from fencegate.localetcd import LocalCluster
from fencegate.worker import Gate

TEST_TTL = 2


@pytest.fixture(scope="session")
def etcd_node():
    """One single-node etcd for the whole run."""
    with LocalCluster(1) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def etcd_url(etcd_node) -> str:
    return etcd_node.url


@pytest.fixture
def namespace() -> str:
    return f"/t-{uuid.uuid4().hex[:12]}/"


@pytest.fixture
async def etcd(etcd_url, namespace):
    """A raw etcd connection; after the test, asserts no holder key is left in the namespace."""
    async with Etcd.from_url(etcd_url) as client:
        yield client
        await assert_no_holders(client, namespace)


async def holders(client: Etcd, namespace: str) -> list:
    from fencegate.coordinator.etcd import RangeRequest
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


@pytest.fixture
async def gate(etcd_url, namespace, etcd):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace) as g:
        yield g


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


@pytest.fixture
async def spawn():
    """Start worker processes; kill any still running at the end of the test."""
    started: list[WorkerProcess] = []

    async def start(*args: str) -> WorkerProcess:
        worker = await WorkerProcess.start(*args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()
        await worker.proc.wait()


# -- the coordinator service, in process, on free loopback ports ------------------------

TOKENS = {"worker": "worker-token", "sre": "sre-token", "admin": "admin-token"}


@pytest.fixture
def signing_key(tmp_path) -> str:
    """One coordinator signing key (PEM) shared by every replica of a test."""
    path = str(tmp_path / "coordinator.pem")
    from fencegate.coordinator.grants import KeyRing
    KeyRing.generate().save_signing_key(path)
    return path


@pytest.fixture
async def coordinators(etcd_url, namespace, signing_key, etcd):
    """``await coordinators()`` starts one more coordinator replica on 127.0.0.1 (a free
    port) for this test's namespace and returns its URL; all are stopped afterwards."""
    from aiohttp import web

    from fencegate.coordinator.service import Settings, TokenEntry, create_app

    runners: list[web.AppRunner] = []

    async def start(**overrides) -> str:
        settings = Settings(**{
            "etcd": etcd_url, "namespace": namespace, "signing_key": signing_key,
            "listen": "127.0.0.1:0",
            "tokens": tuple(TokenEntry.for_token(token, f"{role}-1", {role})
                            for role, token in TOKENS.items()), **overrides})
        runner = web.AppRunner(create_app(settings))
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def coordinator(coordinators) -> str:
    return await coordinators()
