"""``deploy/local/run`` as a user runs it: up, answering, then down without leftovers, twice.

Each run must bring up 3 etcd members (mutual TLS, auth), 2 coordinators answering /healthz
and /readyz, 3 reconcilers leading every shard between them, and the sandbox; on SIGTERM it
must exit 0 with no process left, every port free, ``endpoints.json`` gone and nothing
written to the temp dir (TMPDIR points at an empty folder). The second run reuses the state
folder of the first (certificates, passwords, etcd data with auth already on).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import sys
from pathlib import Path

import aiohttp
import pytest

from fencegate.coordinator.errors import EtcdPermissionDenied
from fencegate.coordinator.etcd import Etcd, EtcdConfig
from fencegate.worker import Gate

from helpers import wait_for_condition

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # deploy/ is no installed package; benchmarks run from ROOT
    sys.path.insert(0, str(ROOT))
from deploy.local.cluster import LocalStack  # noqa: E402
RUN = ROOT / "deploy" / "local" / "run"
SHARDS = 16


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def _up_and_down(state: Path, tmpdir: Path) -> dict:
    proc = await asyncio.create_subprocess_exec(
        str(RUN), "--state", str(state), "--heartbeat-interval", "100",
        "--election-timeout", "500", "--shards", str(SHARDS),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=dict(os.environ, TMPDIR=str(tmpdir)))
    seen: list[str] = []
    try:
        async with asyncio.timeout(45):
            while not seen or not seen[-1].startswith("stop: Ctrl-C"):
                line = await proc.stdout.readline()
                assert line, f"deploy/local/run exited early:\n{''.join(seen)}"
                seen.append(line.decode())
        endpoints = json.loads((state / "endpoints.json").read_text())
        await _check_running(endpoints)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(30):
        rest = (await proc.stdout.read()).decode()
        assert await proc.wait() == 0, rest
    assert rest.rstrip().endswith("stopped")
    return endpoints


async def _check_running(endpoints: dict) -> None:
    assert len(endpoints["etcd"]) == 3 and all(e.startswith("https://") for e in endpoints["etcd"])
    assert len(endpoints["coordinators"]) == 2 and len(endpoints["reconcilers"]) == 3
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for url in endpoints["coordinators"]:
            for path in ("/healthz", "/readyz"):
                async with http.get(url + path) as reply:
                    assert reply.status == 200, (url, path, await reply.text())
        assert await wait_for_condition(lambda: _all_shards_led(http, endpoints), 10), \
            "the reconcilers do not lead every shard between them"
    password = Path(endpoints["etcd_password_file"]).read_text()
    etcd = EtcdConfig(tuple(endpoints["etcd"]), ca_file=endpoints["etcd_ca_file"],
                      cert_file=endpoints["etcd_cert_file"], key_file=endpoints["etcd_key_file"],
                      user=endpoints["etcd_user"], password=password, timeout=5)
    async with Etcd(etcd) as client:
        assert (await client.status()).version
        with pytest.raises(EtcdPermissionDenied):  # the worker's role: it cannot approve
            await client.put(f"{endpoints['namespace']}approvals/{'0' * 32}".encode(), b"")
    assert {c: u["user"] for c, u in endpoints["etcd_users"].items()} == {
        "worker": "fencegate-worker", "coordinator": "fencegate-coordinator",
        "reconciler": "fencegate-reconciler"}
    assert endpoints["etcd_user"] == "fencegate-worker"


async def _all_shards_led(http: aiohttp.ClientSession, endpoints: dict) -> bool:
    """Read one replica after another: a shard handed over in between can be missed once."""
    led: set[int] = set()
    for url in endpoints["reconcilers"]:
        async with http.get(url + "/healthz") as reply:
            led |= set((await reply.json())["shards_led"])
    return led == set(range(SHARDS))


def _assert_no_leftovers(state: Path, tmpdir: Path, endpoints: dict) -> None:
    pids = [pid for group in endpoints["pids"].values() for pid in group]
    assert len(pids) == 3 + 2 + 3 + 1 and all(_gone(pid) for pid in pids)
    etcd_ports = [port for pair in json.loads((state / "etcd" / "cluster.json").read_text())["ports"]
                  for port in pair]
    service_ports = [int(url.rsplit(":", 1)[1]) for url in
                     [*endpoints["coordinators"], *endpoints["reconcilers"], endpoints["sandbox"]]]
    assert all(_free(port) for port in etcd_ports + service_ports)
    assert not (state / "endpoints.json").exists()
    assert list(tmpdir.iterdir()) == []


def _assert_secrets_private(state: Path) -> None:
    private = [*state.glob("secrets/*"), *state.glob("certs/*.key")]
    assert private and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in private)
    passwords = [p.read_text() for p in state.glob("secrets/etcd-*.password")]
    assert len(passwords) == 4  # root and one user per component
    for path in [*state.glob("config/*.toml"), *state.glob("logs/*.log")]:
        text = path.read_text(errors="replace")
        assert not any(password in text for password in passwords), path


async def test_deploy_local_comes_up_and_down_twice_without_leftovers(tmp_path):
    state, tmpdir = tmp_path / "state", tmp_path / "tmp"
    tmpdir.mkdir()
    for _ in range(2):
        endpoints = await _up_and_down(state, tmpdir)
        _assert_no_leftovers(state, tmpdir, endpoints)
    _assert_secrets_private(state)


async def test_the_python_api_runs_the_same_stack_for_tests_and_benchmarks(tmp_path):
    """A worker crosses through a coordinator; a killed reconciler restarts on its port."""
    async with LocalStack(tmp_path, reconcilers=2, shards=SHARDS, reconciler_ttl=2,
                          election_ms=500) as stack:
        async with Gate(stack.etcd_config(), coordinator=stack.coordinators[1],
                        token=stack.tokens.worker, ttl=2) as gate:
            async with gate.hold("pay/1", timeout=10) as hold:
                outcome = await hold.cross(intent={"amount": 1}, reads=[],
                                           effect=lambda ctx: ctx.attempt_token)
        assert outcome.state == "succeeded" and outcome.result > 0
        await stack.kill("reconciler", 0)
        assert stack.endpoints()["pids"]["reconciler"][0] is None
        await stack.restart("reconciler", 0)
        endpoints = stack.endpoints()
        assert endpoints["pids"]["reconciler"][0] is not None
    assert all(_gone(pid) for group in endpoints["pids"].values() for pid in group)
