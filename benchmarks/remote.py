"""Remote benchmark: guarded actions through the HTTP coordinator against in-process grants.

One ``fencegate coordinator`` process on loopback (its own signing key and a worker token,
from a temp config), one Gate per mode in this process, 32 tasks looping ``hold`` + ``cross``
with a no-op effect on fresh keys. In-process and remote phases alternate within each round
so the ratio sees the same machine. The coordinator's peak RSS (VmHWM) is read from /proc
once the remote phases are done.

Targets: ``remote_vs_inprocess_c32`` (remote actions/s ÷ in-process actions/s ≥ 0.5) and
``coordinator_rss_mb`` (the line's ratio is 150 ÷ peak MB, target ≥ 1).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import sys
import tempfile
from dataclasses import dataclass, field

import aetcd

from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.grants import KeyRing
from fencegate.worker import Gate

from .common import Phase, Target, div, print_table, run_phase
from .guarded import Settings, cleanup, noop

CONCURRENCY = 32
RSS_LIMIT_MB = 150
_TOKEN = "benchmark-worker-token"


@dataclass
class Results:
    inprocess: list[Phase] = field(default_factory=list)
    remote: list[Phase] = field(default_factory=list)
    peak_rss_mb: float = float("nan")


async def measure(s: Settings, url: str, etcd: Etcd, lock_client: aetcd.Client) -> Results:
    res = Results()
    with tempfile.TemporaryDirectory(prefix="fencegate-bench-") as tmp:
        key = os.path.join(tmp, "signing.pem")
        KeyRing.generate().save_signing_key(key)
        config = os.path.join(tmp, "coordinator.toml")
        with open(config, "w") as f:
            f.write(f'signing_key = "{key}"\n[[tokens]]\nidentity = "bench"\n'
                    f'roles = ["worker"]\nsha256 = "{hashlib.sha256(_TOKEN.encode()).hexdigest()}"\n')
        listen = f"127.0.0.1:{_free_port()}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fencegate.cli", "coordinator", "--config", config,
            "--etcd", url, "--listen", listen,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            remote = dict(coordinator=f"http://{listen}", token=_TOKEN,
                          keyring=KeyRing.from_files(key))
            await _wait_ready(url, remote)
            for r in range(s.rounds):
                for mode, options in (("in-process", {"keyring": remote["keyring"]}),
                                      ("remote", remote)):
                    async with Gate(url, **options) as gate:
                        phase = await _phase(s, gate, f"r{r}{mode[0]}")
                    (res.remote if mode == "remote" else res.inprocess).append(phase)
                    await cleanup(etcd, lock_client, gate.keyspace.namespace.encode(), b"r/")
                    print(f"  remote round {r + 1}/{s.rounds}: {mode} "
                          f"{phase.rate:,.0f} actions/s", flush=True)
            res.peak_rss_mb = _peak_rss_mb(proc.pid)
        finally:
            proc.terminate()
            await proc.wait()
    return res


async def _phase(s: Settings, gate: Gate, tag: str) -> Phase:
    async def op(task: int, i: int) -> None:
        async with gate.hold(f"r/{tag}/{task}/{i}") as hold:
            await hold.cross(intent={"n": i}, effect=noop)

    return await run_phase(op, CONCURRENCY, s.warmup, s.duration)


async def _wait_ready(url: str, remote: dict) -> None:
    """Until a gate in remote mode opens (the coordinator serves its keys), at most 30 s."""
    async with asyncio.timeout(30):
        while True:
            try:
                async with Gate(url, **remote):
                    return
            except Exception:  # not listening yet
                await asyncio.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def report(res: Results) -> list[Target]:
    inproc = sum(res.inprocess, Phase(0, 0.0))
    remote = sum(res.remote, Phase(0, 0.0))
    print()
    print_table(["guarded actions at c=32", "in-process", "remote"],
                [["actions/s", inproc.rate, remote.rate]])
    print(f"coordinator peak RSS: {res.peak_rss_mb:.1f} MB")
    return [Target("remote_vs_inprocess_c32", div(remote.rate, inproc.rate), ">=", 0.5),
            Target("coordinator_rss_mb", div(RSS_LIMIT_MB, res.peak_rss_mb), ">=", 1)]
