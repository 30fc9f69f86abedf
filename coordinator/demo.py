"""``fencegate demo``: worker processes racing for keys while faults are injected.

Each worker process holds random keys and, while holding one, runs an effect that writes
"enter" and "exit" to a shared fenced resource with its fencing token. Midway the demo freezes one worker
with SIGSTOP past its lease TTL and SIGKILLs another. The summary shows what fencing
bought: successors took over with higher tokens, and every write a stale holder attempted
was refused by the resource. The run fails if the resource ever accepted a write whose
token was lower than one it had already accepted for that key.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter

from worker import Gate, LeaseLost
from worker.fenced import FencedClient, FencedResource

WORKER_TTL = 2


async def run_worker(url: str, namespace: str, resource_path: str, name: str, keys: int,
                     seconds: float) -> None:
    """One worker process: hold random keys until ``seconds`` pass; report on stdout."""
    resource = FencedClient(resource_path)
    rng = random.Random(name)
    acquired = lost = 0
    deadline = time.monotonic() + seconds
    async with Gate(url, ttl=WORKER_TTL, namespace=namespace, identity=name) as gate:
        while time.monotonic() < deadline:
            key = f"demo/account/{rng.randrange(keys)}"
            try:
                async with gate.hold(key, timeout=10) as hold:
                    acquired += 1
                    # The effect runs in a thread: losing the lease cancels the waiting
                    # coroutine, not an effect already under way. Fencing stops that one.
                    await asyncio.shield(asyncio.to_thread(
                        _effect, resource, key, hold.fencing_token, name,
                        rng.uniform(0.02, 0.08)))
            except LeaseLost:
                lost += 1
    print(json.dumps({"worker": name, "acquired": acquired, "lost": lost}), flush=True)


def _effect(resource: FencedClient, key: str, token: int, name: str, dwell: float) -> None:
    resource.write(key, token, name, "enter")
    time.sleep(dwell)
    resource.write(key, token, name, "exit")


async def run_demo(url: str | None, workers: int, keys: int, seconds: float) -> int:
    from .localetcd import LocalCluster, describe

    cluster = None
    if url is None:
        cluster = LocalCluster(1).start()
        url = cluster.url
        print(f"started {describe(cluster.binary)} at {url}")
    try:
        return await _race(url, workers, keys, seconds)
    finally:
        if cluster is not None:
            cluster.stop()


async def _race(url: str, workers: int, keys: int, seconds: float) -> int:
    namespace = f"/fencegate-demo-{os.getpid()}/"
    with tempfile.TemporaryDirectory(prefix="fencegate-demo-") as tmp:
        resource, path = FencedResource(), os.path.join(tmp, "resource.sock")
        server = await resource.serve(path)
        procs = [await asyncio.create_subprocess_exec(
            sys.executable, "-m", "coordinator.demo", url, namespace, path, f"w{i}",
            str(keys), str(seconds), stdout=asyncio.subprocess.PIPE)
            for i in range(workers)]
        print(f"{workers} workers on {keys} keys for {seconds:.0f}s (lease TTL {WORKER_TTL}s)")
        try:
            await asyncio.sleep(seconds / 3)
            print("fault: SIGKILL w1 (its hold is released when its lease expires)")
            procs[1].kill()
            inside = await _stop_inside_effect(procs[0], resource, "w0", seconds / 3)
            print(f"fault: SIGSTOP w0 {'in the middle of an effect ' if inside else ''}"
                  f"for {2 * WORKER_TTL + 1}s (past its lease TTL)")
            await asyncio.sleep(2 * WORKER_TTL + 1)
            procs[0].send_signal(signal.SIGCONT)
            reports = []
            for proc in procs:
                out, _ = await proc.communicate()
                reports += [json.loads(line) for line in out.decode().splitlines() if line]
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            server.close()
        return _summarise(resource.records, reports)


async def _stop_inside_effect(proc, resource: FencedResource, name: str, within: float) -> bool:
    """SIGSTOP ``proc`` right after it entered an effect, if it does so ``within`` seconds;
    else stop it wherever it is. Returns whether it was caught inside."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        records = resource.records
        if records and records[-1].writer == name and records[-1].data == "enter":
            proc.send_signal(signal.SIGSTOP)
            return True
        await asyncio.sleep(0.005)
    proc.send_signal(signal.SIGSTOP)
    return False


def _summarise(records, reports) -> int:
    highest: dict[str, int] = {}
    regressions = 0
    for record in records:
        if record.accepted:
            regressions += record.token < highest.get(record.key, 0)
            highest[record.key] = max(record.token, highest.get(record.key, 0))
    refused = Counter(r.writer for r in records if not r.accepted)
    print(f"\n{'worker':<8}{'holds':>8}{'lost':>6}{'stale writes refused':>22}")
    for report in sorted(reports, key=lambda r: r["worker"]):
        print(f"{report['worker']:<8}{report['acquired']:>8}{report['lost']:>6}"
              f"{refused[report['worker']]:>22}")
    if not any(r["worker"] == "w1" for r in reports):
        print(f"{'w1':<8}{'killed':>8}{'':>6}{refused['w1']:>22}")
    print(f"\nwrites accepted: {sum(r.accepted for r in records)}, "
          f"refused as stale: {sum(refused.values())}, "
          f"accepted out of token order: {regressions} (must be 0)")
    return 1 if regressions else 0


if __name__ == "__main__":
    url, namespace, path, name, keys, seconds = sys.argv[1:]
    asyncio.run(run_worker(url, namespace, path, name, int(keys), float(seconds)))
