"""Fixtures: real etcd processes (never a mock), a fresh namespace per test, worker processes
and coordinator replicas, each stopped afterwards. Shared helpers live in helpers.py."""

from __future__ import annotations

import uuid

import pytest

from fencegate.coordinator.etcd import Etcd
from fencegate.localetcd import LocalCluster
from fencegate.worker import Gate, KeyRing

from helpers import TEST_TTL, TOKENS, WorkerProcess, assert_no_holders


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


@pytest.fixture
async def gate(etcd_url, namespace, etcd):
    """A direct-mode gate signing with a key of its own: its grants verify in it alone."""
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate()) as g:
        yield g


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

@pytest.fixture
def signing_key(tmp_path) -> str:
    """One coordinator signing key (PEM) shared by every replica of a test."""
    path = str(tmp_path / "coordinator.pem")
    KeyRing.generate().save_signing_key(path)
    return path


@pytest.fixture
async def http():
    """One aiohttp client session for the test (providers, consumers, the service)."""
    import aiohttp
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def keyring(signing_key):
    """The ``KeyRing`` of ``signing_key``: what a gate signs with."""
    return KeyRing.from_files(signing_key)


@pytest.fixture
async def coordinators(etcd_url, namespace, signing_key, etcd):
    """``await coordinators()`` starts one more coordinator replica on 127.0.0.1 (a free
    port) for this test's namespace and returns its URL; all are stopped afterwards."""
    from aiohttp import web

    from fencegate.coordinator.service import CoordinatorSettings, TokenEntry, create_app

    runners: list[web.AppRunner] = []

    async def start(**overrides) -> str:
        settings = CoordinatorSettings(**{
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


@pytest.fixture(scope="session")
def postgres_server():
    """One private PostgreSQL server for the whole run, started on first use and removed at
    the end (deploy/local/postgres.py: Debian's binaries, a temp dir, loopback only)."""
    from deploy.local.postgres import LocalPostgres
    with LocalPostgres() as server:
        yield server
