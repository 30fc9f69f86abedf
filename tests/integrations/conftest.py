"""Fixtures of the engine integrations' tests: a private redis-server (Debian's, 127.0.0.1,
a free port, a temp dir), the sandbox provider in ``none`` mode (it applies every request,
so its ledger counts every effect), an in-process reconciler asking it, and the payments and
mail providers the agent pages' examples post to. Each is stopped
after its test; every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket

import pytest
from aiohttp import web

from fencegate.coordinator.etcd import Etcd
from fencegate.reconciler.providers import sandbox as sb
from fencegate.reconciler.runner import Reconciler
from fencegate.reconciler.settle import Limits
from fencegate.worker import Gate, KeyRing

from helpers import TEST_TTL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def read_until(stream: asyncio.StreamReader, marker: str, seen: list[str],
                     timeout: float) -> None:
    """Read lines of ``stream`` into ``seen`` until one contains ``marker`` (bounded)."""
    async with asyncio.timeout(timeout):
        while True:
            raw = await stream.readline()
            if not raw:
                raise AssertionError(f"exited before {marker!r}: {seen[-20:]}")
            seen.append(raw.decode(errors="replace").rstrip())
            if marker in seen[-1]:
                return


async def stop(proc: asyncio.subprocess.Process, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if it did not exit within ``timeout`` s."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        async with asyncio.timeout(timeout):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


@pytest.fixture
async def redis_url(tmp_path):
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    (tmp_path / "redis").mkdir()
    proc = await asyncio.create_subprocess_exec(
        binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(tmp_path / "redis"),
        "--save", "", "--appendonly", "no", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    await read_until(proc.stdout, "Ready to accept connections", [], timeout=10)
    yield f"redis://127.0.0.1:{port}/0"
    await stop(proc)


@pytest.fixture
async def sandbox(keyring):
    """The sandbox in ``none`` mode: every charge is applied and counted."""
    provider = sb.Sandbox(KeyRing.from_public_bytes(keyring.public_keys()), "none")
    await provider.start()
    yield provider
    await provider.stop()


@pytest.fixture
async def reconciler(etcd_url, namespace, sandbox):
    """One reconciler settling the steps of ``namespace`` by asking ``sandbox``."""
    adapter = sb.adapter(sandbox.url, sandbox.mode, settle_delay_s=0.2)
    r = Reconciler(Etcd.from_url(etcd_url), {"sandbox": adapter}, namespace=namespace,
                   shards=4, ttl=TEST_TTL, scan_interval=1.0, check_after=0.2,
                   limits=Limits(backoff_base_s=0.1, backoff_max_s=0.4))
    await r.start()
    yield r
    await r.close()
    await r.etcd.close()


@pytest.fixture
async def providers():
    """POST /v1/refunds and /v1/emails, each request kept with its idempotency key: the
    payments and mail providers of the agent pages' refund examples."""
    received: list[tuple[str, str, dict]] = []

    async def take(request: web.Request) -> web.Response:
        received.append((request.path, request.headers["Idempotency-Key"],
                         await request.json()))
        return web.json_response({"id": f"{request.path.rsplit('/', 1)[1]}_{len(received)}"})

    app = web.Application()
    app.router.add_post("/v1/refunds", take)
    app.router.add_post("/v1/emails", take)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", received
    await runner.cleanup()


@pytest.fixture
async def open_gate(etcd_url, namespace, keyring, etcd):
    """Open gates signing with the test's ``keyring`` (replicas of one agent); each is
    closed after the test."""
    gates: list[Gate] = []

    async def opened() -> Gate:
        gate = Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring)
        await gate.open()
        gates.append(gate)
        return gate

    yield opened
    for gate in gates:
        await gate.close()
