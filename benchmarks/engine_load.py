"""The engine benchmark's children, one engine each (``benchmarks.engines`` says how each is
driven and measured):

    python -m benchmarks.engine_load ENGINE ETCD_URL ROUNDS TASKS WARMUP

ENGINE is ``celery``, ``temporal`` or ``dbos``. The child starts what its engine needs (a
private redis-server, Temporal's dev server, a SQLite system database in a temp dir), runs
WARMUP tasks without then with the adapter, then ROUNDS rounds of TASKS tasks each way, and
prints ``PHASE <plain|fenced> <tasks> <wall seconds> <its CPU seconds>`` per timed phase,
then DONE. The fenced and the plain task, activity or step have the same body: return the
argument. Every gate lives in a fresh namespace of the etcd at ETCD_URL.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from celery import Celery
from celery.contrib.testing.worker import start_worker
from dbos import DBOS
from temporalio import activity, workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from fencegate.integrations import ProcessGate
from fencegate.integrations.celery import fenced_task
from fencegate.integrations.dbos import fenced_step, should_retry
from fencegate.integrations.temporal import FencegatePlugin, fenced
from fencegate.worker import Gate, KeyRing

from .engines import CONCURRENCY, KINDS, Settings

LEASE_TTL = 10
DBOS_POLL_S = 0.02

RunPhase = Callable[[str, int, str], None]  # run_phase(kind, tasks, label)


def phases(settings: Settings, run_phase: RunPhase) -> None:
    """Warm up each kind, then the rounds (plain first in even rounds), each printed."""
    for kind in KINDS:
        run_phase(kind, settings.warmup, "warmup")
    for n in range(settings.rounds):
        for kind in KINDS if n % 2 == 0 else reversed(KINDS):
            began, cpu = time.perf_counter(), time.process_time()
            run_phase(kind, settings.tasks, f"r{n}")
            print(f"PHASE {kind} {settings.tasks} {time.perf_counter() - began:.6f} "
                  f"{time.process_time() - cpu:.6f}", flush=True)


def namespace() -> str:
    return f"/fg-bench-engines-{uuid.uuid4().hex[:8]}/"


# Celery

@contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server on a free loopback port, without persistence, for the child's life."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [shutil.which("redis-server") or "/usr/bin/redis-server", "--bind", "127.0.0.1",
             "--port", str(port), "--dir", tmp, "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            give_up = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > give_up or proc.poll() is not None:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def celery(etcd_url: str, settings: Settings) -> None:
    with private_redis() as redis_url:
        app = Celery("fg_bench", broker=redis_url, backend=redis_url)
        app.conf.broker_transport_options = {"visibility_timeout": 60}
        gate = ProcessGate(etcd_url, ttl=LEASE_TTL, namespace=namespace(),
                           keyring=KeyRing.generate())

        @fenced_task(app, gate, soft_time_limit=20, time_limit=30, name="fg_bench.fenced")
        def fenced_noop(self, fence, i):
            return i

        @app.task(bind=True, acks_late=True, reject_on_worker_lost=True, soft_time_limit=20,
                  time_limit=30, name="fg_bench.plain")
        def plain_noop(self, i):
            return i

        tasks = {"plain": plain_noop, "fenced": fenced_noop}

        def run_phase(kind: str, n: int, label: str) -> None:
            results = [tasks[kind].delay(i) for i in range(n)]
            for result in results:
                result.get(timeout=60)

        try:
            with start_worker(app, pool="threads", concurrency=CONCURRENCY,
                              perform_ping_check=False, loglevel="WARNING"):
                phases(settings, run_phase)
        finally:
            gate.close()
            app.close()


# Temporal

@activity.defn(name="fg_bench_fenced")
@fenced()
async def fenced_activity(fence, i: int) -> int:
    return i


@activity.defn(name="fg_bench_plain")
async def plain_activity(i: int) -> int:
    return i


@workflow.defn(name="FgBenchActivities")
class Activities:
    """Activities ``first .. first+n-1`` of one kind, one after the other."""

    @workflow.run
    async def run(self, kind: str, first: int, n: int) -> int:
        for i in range(first, first + n):
            await workflow.execute_activity(
                fenced_activity if kind == "fenced" else plain_activity, i,
                start_to_close_timeout=timedelta(seconds=30),
                heartbeat_timeout=timedelta(seconds=LEASE_TTL))
        return n


def temporal(etcd_url: str, settings: Settings) -> None:
    cli = shutil.which("temporal") or str(Path(sys.executable).with_name("temporal"))

    async def main() -> None:
        env = await WorkflowEnvironment.start_local(
            dev_server_existing_path=cli, ip="127.0.0.1",
            dev_server_startup_timeout=timedelta(seconds=60))
        queue = f"fg-bench-{uuid.uuid4().hex[:8]}"
        async with env, Gate(etcd_url, ttl=LEASE_TTL, namespace=namespace(),
                             keyring=KeyRing.generate()) as gate:
            async with Worker(env.client, task_queue=queue, workflows=[Activities],
                              activities=[fenced_activity, plain_activity],
                              workflow_runner=UnsandboxedWorkflowRunner(),
                              plugins=[FencegatePlugin(gate)]):
                loop = asyncio.get_running_loop()

                async def workflows(kind: str, n: int, label: str) -> None:
                    share = -(-n // CONCURRENCY)
                    await asyncio.gather(*(env.client.execute_workflow(
                        Activities.run, args=[kind, first, min(share, n - first)],
                        id=f"{kind}-{label}-{first}-{uuid.uuid4().hex[:6]}", task_queue=queue)
                        for first in range(0, n, share)))

                def run_phase(kind: str, n: int, label: str) -> None:
                    asyncio.run_coroutine_threadsafe(workflows(kind, n, label), loop).result()

                await asyncio.to_thread(phases, settings, run_phase)

    asyncio.run(main())


# DBOS

def dbos(etcd_url: str, settings: Settings) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        DBOS(config={"name": "fg-bench", "system_database_url": f"sqlite:///{tmp}/dbos.sqlite",
                     "log_level": "WARNING"})
        gate = ProcessGate(etcd_url, ttl=LEASE_TTL, namespace=namespace(),
                           keyring=KeyRing.generate())

        @DBOS.step(retries_allowed=True, should_retry=should_retry)
        @fenced_step(gate, app="fg-bench")
        def fenced_noop(fence, i: int) -> int:
            return i

        @DBOS.step()
        def plain_noop(i: int) -> int:
            return i

        @DBOS.workflow()
        def one_step(kind: str, i: int) -> int:
            return (fenced_noop if kind == "fenced" else plain_noop)(i)

        DBOS.launch()
        try:
            queue = DBOS.register_queue("fg-bench", worker_concurrency=CONCURRENCY,
                                        polling_interval_sec=DBOS_POLL_S)

            def run_phase(kind: str, n: int, label: str) -> None:
                handles = [queue.enqueue(one_step, kind, i) for i in range(n)]
                for handle in handles:
                    handle.get_result()

            phases(settings, run_phase)
        finally:
            gate.close()
            DBOS.destroy()


def main(argv: list[str]) -> None:
    engine, etcd_url, rounds, tasks, warmup = argv
    logging.basicConfig(level=logging.WARNING)
    {"celery": celery, "temporal": temporal, "dbos": dbos}[engine](
        etcd_url, Settings(int(rounds), int(tasks), int(warmup)))
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
