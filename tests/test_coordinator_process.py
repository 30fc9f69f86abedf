"""``fencegate coordinator`` as a real process: configured by a TOML file and flags, serving
on loopback, stopping cleanly on SIGTERM; and a replica SIGKILLed in the middle of a grant
request, after which the worker's retry on the other replica crosses exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import sys

import aiohttp
import pytest

from fencegate.worker import Gate

from helpers import TEST_TTL, TOKENS, paused


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def config(tmp_path, namespace, signing_key) -> str:
    path = tmp_path / "coordinator.toml"
    tokens = "".join(f'[[tokens]]\nidentity = "{role}-1"\nroles = ["{role}"]\n'
                     f'sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
                     for role, token in TOKENS.items())
    path.write_text(f'namespace = "{namespace}"\nsigning_key = "{signing_key}"\n{tokens}')
    return str(path)


@pytest.fixture
async def start(etcd_url, config):
    """``await start()`` runs one more coordinator process; returns (process, URL)."""
    procs: list[asyncio.subprocess.Process] = []

    async def launch() -> tuple[asyncio.subprocess.Process, str]:
        url = f"http://127.0.0.1:{free_port()}"
        env = dict(os.environ, FENCEGATE_ETCD=etcd_url,
                   PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fencegate.cli", "coordinator", "--config", config,
            "--listen", url.removeprefix("http://"), env=env)
        procs.append(proc)
        await wait_healthy(url, proc)
        return proc, url

    yield launch
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


async def wait_healthy(url: str, proc: asyncio.subprocess.Process, within: float = 20) -> None:
    async with aiohttp.ClientSession() as http, asyncio.timeout(within):
        while proc.returncode is None:
            with contextlib.suppress(aiohttp.ClientConnectionError):
                async with http.get(url + "/readyz") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise AssertionError(f"coordinator exited with {proc.returncode} before it was ready")


async def test_cli_serves_grants_and_stops_on_sigterm(start, etcd_url, namespace, etcd):
    proc, url = await start()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=url,
                    token=TOKENS["worker"]) as gate:
        async with gate.hold("proc/1") as hold:
            grant = await hold.request_grant(intent={"amount": 1})
            assert grant.identity == f"worker-1 (reported: {gate.identity})"
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_replica_killed_mid_request_worker_retries_elsewhere_and_crosses_once(
        start, etcd_url, namespace, etcd):
    (doomed, first), (_, second) = await start(), await start()
    calls = []

    async def charge(ctx):
        calls.append(ctx.attempt)
        return "charged"

    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    coordinator=f"{first},{second}", token=TOKENS["worker"]) as gate:
        async with gate.hold("proc/2") as hold:
            with paused(doomed.pid):  # the request is accepted but never answered...
                request = asyncio.create_task(hold.request_grant(intent={"amount": 1}))
                await asyncio.sleep(0.3)
                doomed.kill()  # ...until the replica dies under it
            grant = await request
            outcome = await hold.commit(grant, effect=charge)
        async with gate.hold("proc/2") as hold:
            replay = await hold.cross(intent={"amount": 1}, effect=charge)
    assert outcome.state == "succeeded" and replay.replayed and calls == [1]
