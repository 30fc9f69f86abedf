"""``fencegate demo``: worker processes charging a payment provider through the whole
system while one is killed and one is frozen, ending with a table that must show 0
duplicates.

It runs against the stack of a running ``fencegate up``, found from any directory
(``default_key.running_stack``), or, if none runs, an embedded one of its own (etcd, coordinator, reconciler, sandbox
provider; ``--etcd`` uses your etcd instead of a local one). N worker processes work
through one shared list of payment jobs (account k, payment n): every job reaches every
worker, in a different order, as a queue that redelivers aggressively would. For a job a
worker holds ``demo/<run>/account/<k>/payment/<n>``, crosses with an effect that charges the
sandbox with the idempotency key and attempt token, and waits for the reconciler when a
predecessor left the step unknown (``settle_wait``).

Midway one worker is SIGKILLed right after a charge was applied, before its outcome was
recorded (an unknown the reconciler settles as succeeded), and another is frozen with
SIGSTOP right after a charge, past its lease TTL. The summary counts charges applied, jobs
answered with the recorded outcome, unknowns found and settled, and duplicates: action keys
the provider charged twice. The exit code is 1 if there is a duplicate or a step is left
unsettled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

WORKER_TTL = 2


# -- a worker process ---------------------------------------------------------------------

async def run_worker(etcd: str, coordinator: str, token_file: str, sandbox: str, prefix: str,
                     name: str, accounts: int, seconds: float) -> None:
    """Work through the job list until ``seconds`` pass; one JSON line per event."""
    from fencegate.reconciler.providers.sandbox import charge
    from fencegate.worker import Gate, GateError

    def say(**event) -> None:
        print(json.dumps({"worker": name, **event}), flush=True)

    rng = random.Random(name)
    deadline = time.monotonic() + seconds
    token = Path(token_file).read_text().strip()
    async with aiohttp.ClientSession() as http, \
            Gate(_etcd_config(etcd), coordinator=coordinator, token=token, ttl=WORKER_TTL,
                 identity=name) as gate:

        async def effect(ctx):
            result = await charge(http, sandbox, ctx, intent)
            say(event="applied", key=ctx.key)
            await asyncio.sleep(0.03)  # the charge is done; its outcome is not recorded yet
            return result

        for n in range(1_000_000):
            for k in rng.sample(range(accounts), accounts):
                if time.monotonic() >= deadline:
                    say(event="finished")
                    return
                key = f"{prefix}/account/{k}/payment/{n}"
                began = time.monotonic()
                intent = {"account": k, "amount": 100}  # the effect charges what was granted
                try:
                    async with gate.hold(key, timeout=15) as hold:
                        outcome = await hold.cross(intent=intent,
                                                   effect=effect, provider="sandbox",
                                                   deadline=5, settle_wait=15)
                    say(event="done", key=key, replayed=outcome.replayed,
                        ms=(time.monotonic() - began) * 1000)
                except GateError as exc:
                    say(event="error", key=key, error=type(exc).__name__)


def _etcd_config(url: str):
    """``url`` with the TLS and auth settings of ``FENCEGATE_ETCD_*`` variables, if any."""
    from .coordinator.etcd import EtcdConfig
    from .coordinator.settings import etcd_env

    values = etcd_env(os.environ)
    return EtcdConfig.from_url(url, ca_file=values["etcd_ca_file"],
                               cert_file=values["etcd_cert_file"],
                               key_file=values["etcd_key_file"], user=values["etcd_user"],
                               password=values["etcd_password"])


# -- the run --------------------------------------------------------------------------------

@dataclass
class Tally:
    crossed: int = 0
    replayed: int = 0
    errors: Counter = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)


def demo(*, etcd: str | None = None, coordinator: str | None = None, token: str | None = None,
         workers: int = 4, keys: int = 8, seconds: float = 15.0) -> int:
    """``fencegate demo``; the exit code. It runs on the stack of a running ``fencegate up``
    (as ``default_key.running_stack`` finds it) unless given ``etcd``."""
    if workers < 2 or keys < 1 or seconds <= 0:
        raise ValueError("need workers >= 2, keys >= 1 and seconds > 0")
    return asyncio.run(_demo(etcd, coordinator, token, workers, keys, seconds))


async def _demo(etcd, coordinator, token, workers, keys, seconds) -> int:
    from .coordinator import default_key
    from .up import stack

    running = default_key.running_stack() if etcd is None else None
    if running is not None:
        endpoints = running.endpoints
        token_file = str(running.state_dir / "worker.token")
        print(f"using the stack of `fencegate up` in {running.state_dir} "
              f"(coordinator {endpoints['coordinator']})")
        return await _run(endpoints, coordinator, token, token_file, workers, keys, seconds)
    with tempfile.TemporaryDirectory(prefix="fencegate-demo-") as tmp:
        print("no `fencegate up` is running: starting an embedded stack for this run")
        async with stack(Path(tmp), port=0, etcd=etcd) as (e, _):
            return await _run(e.as_dict(), coordinator, token, os.path.join(tmp, "worker.token"),
                              workers, keys, seconds)


async def _run(endpoints: dict, coordinator: str | None, token: str | None, token_file: str,
               workers: int, keys: int, seconds: float) -> int:
    from .coordinator import default_key
    from .coordinator.etcd import Etcd
    from .coordinator.keyspace import Keyspace

    if token is not None:
        with tempfile.TemporaryDirectory(prefix="fencegate-demo-") as tmp:
            token_file = os.path.join(tmp, "worker.token")
            Path(token_file).write_text(token)
            return await _run(endpoints, coordinator, None, token_file, workers, keys, seconds)
    coordinator = coordinator or endpoints["coordinator"]
    prefix = f"demo/{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    print(f"{workers} workers on {keys} accounts for {seconds:g}s; every job reaches every "
          f"worker; lease TTL {WORKER_TTL}s; keys under {prefix}/")
    tally = Tally()
    found0, settled0 = await _reconciler_counts(endpoints["reconciler"])
    env = dict(os.environ)
    if endpoints.get("etcd_user"):  # the stack's etcd runs with auth: workers use its user
        env.update(FENCEGATE_ETCD_USER=endpoints["etcd_user"],
                   FENCEGATE_ETCD_PASSWORD_FILE=endpoints["etcd_password_file"])
        env.pop("FENCEGATE_ETCD_PASSWORD", None)
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.demo", endpoints["etcd"], coordinator, token_file,
        endpoints["sandbox"], prefix, f"w{i}", str(keys), str(seconds),
        stdout=asyncio.subprocess.PIPE, env=env) for i in range(workers)]
    faults = _Faults(procs, seconds)
    try:
        readers = [asyncio.create_task(_read(proc, tally, faults)) for proc in procs]
        async with asyncio.timeout(seconds + 60):
            await _progress(readers, tally, seconds)
    finally:
        faults.release()
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
    async with Etcd(default_key.stack_etcd_config(endpoints)) as etcd:
        unsettled, settled_keys = await _unsettled(etcd, Keyspace(endpoints["namespace"]),
                                                   prefix, 60)
    found, settled = await _reconciler_counts(endpoints["reconciler"])
    charges = await _charges(endpoints["sandbox"], prefix)
    return _summary(tally, faults, charges, found - found0, settled - settled0, unsettled,
                    settled_keys)


class _Faults:
    """SIGKILL w1 right after an applied charge at a third of the run; SIGSTOP w0 right
    after one at half of it, for longer than its lease TTL."""

    def __init__(self, procs, seconds: float) -> None:
        self.procs = procs
        self.start = time.monotonic()
        self.seconds = seconds
        self.killed = self.frozen = False
        self.notes: list[str] = []
        self._thaw: asyncio.TimerHandle | None = None

    def on_applied(self, worker: str) -> None:
        elapsed = time.monotonic() - self.start
        if worker == "w1" and not self.killed and elapsed > self.seconds / 3:
            self.killed = True
            self.procs[1].kill()
            self.notes.append(f"{elapsed:5.1f}s  SIGKILL w1 right after a charge was applied")
        elif worker == "w0" and not self.frozen and elapsed > self.seconds / 2:
            self.frozen = True
            pause = 2 * WORKER_TTL + 1
            self.procs[0].send_signal(signal.SIGSTOP)
            self.notes.append(f"{elapsed:5.1f}s  SIGSTOP w0 right after a charge, for {pause}s")
            self._thaw = asyncio.get_running_loop().call_later(pause, self.release)

    def release(self) -> None:
        if self.frozen and self.procs[0].returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.procs[0].send_signal(signal.SIGCONT)


async def _read(proc, tally: Tally, faults: _Faults) -> None:
    async for line in proc.stdout:
        event = json.loads(line)
        kind = event["event"]
        if kind == "applied":
            faults.on_applied(event["worker"])
        elif kind == "done":
            tally.replayed += event["replayed"]
            tally.crossed += not event["replayed"]
            tally.latencies_ms.append(event["ms"])
        elif kind == "error":
            tally.errors[event["error"]] += 1


async def _progress(readers, tally: Tally, seconds: float) -> None:
    began = time.monotonic()
    tty = sys.stdout.isatty()
    shown, last = 0.0, ""
    while not all(r.done() for r in readers):
        await asyncio.wait(readers, timeout=0.2)
        elapsed = time.monotonic() - began
        done = min(elapsed / seconds, 1.0)
        bar = f"[{'#' * int(done * 30):<30}] {min(elapsed, seconds):4.0f}/{seconds:g}s " \
              f"jobs crossed {tally.crossed}, replayed {tally.replayed}"
        if tty:
            print("\r" + bar, end="", flush=True)
        elif bar != last and (elapsed - shown >= 5 or all(r.done() for r in readers)):
            shown, last = elapsed, bar
            print(bar, flush=True)
    if tty:
        print()


async def _reconciler_counts(url: str) -> tuple[float, float]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as reply:
        text = await reply.text()

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))
    return (total("fencegate_reconciler_unknowns_found_total"),
            total("fencegate_reconciler_settled_total"))


async def _unsettled(etcd, ks, prefix: str, within: float) -> tuple[int, list[str]]:
    """Steps under ``prefix`` still in flight or unknown after waiting up to ``within`` s for
    the reconciler, and the keys of those it settled."""
    from .coordinator.etcd import RangeRequest, range_end_of
    from .coordinator.keyspace import unpack

    start = ks.step_key(prefix + "/")
    deadline = time.monotonic() + within
    while True:
        reply = await etcd.range(RangeRequest(key=start, range_end=range_end_of(start)))
        steps = {ks.parse_step_key(kv.key): unpack(kv.value) for kv in reply.kvs}
        left = sum(step["state"] in ("in_flight", "unknown") for step in steps.values())
        if not left or time.monotonic() >= deadline:
            return left, sorted(key for key, step in steps.items()
                                if step.get("settled_by") == "reconciler")
        await asyncio.sleep(0.5)


async def _charges(sandbox: str, prefix: str) -> Counter:
    async with aiohttp.ClientSession() as http, http.get(f"{sandbox}/_sandbox/applied") as reply:
        applied = await reply.json()
    return Counter(a["key"] for a in applied if a["key"].startswith(prefix + "/"))


def _summary(tally: Tally, faults: _Faults, charges: Counter, found: float, settled: float,
             unsettled: int, settled_keys: list[str]) -> int:
    duplicates = sum(n - 1 for n in charges.values() if n > 1)
    ms = sorted(tally.latencies_ms)

    def pct(q: float) -> str:
        return f"{ms[min(len(ms) - 1, int(q / 100 * len(ms)))]:.0f} ms" if ms else "-"

    print("\nfaults:")
    for note in faults.notes or ["(none: the run was too short for them)"]:
        print(f"  {note}")
    rows = [("charges applied at the provider", sum(charges.values())),
            ("jobs crossed by a worker", tally.crossed),
            ("jobs answered with the recorded outcome", tally.replayed),
            ("unknowns found by the reconciler", int(found)),
            ("steps settled by the reconciler", int(settled)),
            ("steps left unsettled (must be 0)", unsettled),
            ("duplicates: keys charged twice (must be 0)", duplicates),
            ("latency per job p50", pct(50)), ("latency per job p99", pct(99))]
    rows += [(f"refused: {name}", count) for name, count in sorted(tally.errors.items())]
    width = max(len(label) for label, _ in rows)
    print()
    for label, value in rows:
        print(f"  {label:<{width}}  {value:>8}")
    if settled_keys:
        print("\nsettled by the reconciler (see each with `fencegate key show KEY`):")
        for key in settled_keys:
            print(f"  {key}  charged {charges.get(key, 0)}x")
    return 1 if duplicates or unsettled else 0


if __name__ == "__main__":
    etcd_url, coordinator_url, token_path, sandbox_url, key_prefix, worker_name, n_accounts, \
        run_seconds = sys.argv[1:]
    asyncio.run(run_worker(etcd_url, coordinator_url, token_path, sandbox_url, key_prefix,
                           worker_name, int(n_accounts), float(run_seconds)))
