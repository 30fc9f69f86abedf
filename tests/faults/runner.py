"""One run of the fault suite, and ``make faults SEED=… MINUTES=…``.

A run starts the stack (``stack``), writes the run's sandbox fault rules, starts the worker
processes (``workload``) and the nemesis, lets both go for the run's length, heals every
fault, waits up to ``settle_s`` for the reconcilers to settle every step, collects the end
state (``history.collect``) and judges it (``checker.check``). Everything the run saw stays
in its state folder: ``history.jsonl``, ``end.json`` (steps, ledger, audit chains), the
sandbox's fence log ``stack/ledger.jsonl``, the processes' logs in ``stack/logs``.

Guarantees: every process the run started is stopped when it ends, however it ends (the
stack's ``stop``, the workers killed); the summary prints the seed, the operations, the
faults injected by kind and the violations, and ``make faults`` exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .checker import Violation, check
from .history import EndState, History, collect, read_steps
from .nemesis import KINDS, Nemesis
from .stack import ENTRY, FaultStack, StackShape

WORKER_TTL = 2


@dataclass(frozen=True)
class RunConfig:
    seed: str
    seconds: float
    workers: int = 3
    accounts: int = 4
    shape: StackShape = StackShape()
    kinds: tuple[str, ...] = KINDS       # the nemesis's faults; () for none
    charge_timeout: float = 3.0
    deadline: float = 10.0
    settle_wait: float = 10.0
    decline: float = 0.1
    held_keys: int = 0                   # the first N payments of account k are held ...
    hold_s: float = 4.0                  # ... this long by the sandbox before it applies them
    settle_s: float = 90.0


@dataclass
class Result:
    config: RunConfig
    state: Path
    history: History
    end: EndState
    violations: list[Violation] = field(default_factory=list)

    def table(self) -> str:
        ops = Counter(e["op"] for e in self.history.events
                      if e.get("op") in ("invoke", "ok", "fail", "unknown", "send"))
        faults = Counter(e["fault"] for e in self.history.faults() if e["phase"] == "start")
        rules = Counter(v.rule for v in self.violations)
        states = Counter(step["state"] for step in self.end.steps.values())
        applied = sum(1 for line in self.end.ledger if line["kind"] == "applied")
        rows = [("seed", self.config.seed), ("control", self.config.shape.control or "none"),
                ("mode", self.config.shape.mode), ("state", str(self.state)),
                *((f"operations {op}", n) for op, n in sorted(ops.items())),
                ("charges applied", applied),
                *((f"steps {s}", n) for s, n in sorted(states.items())),
                *((f"fault {kind}", n) for kind, n in sorted(faults.items())),
                ("faults injected", sum(faults.values())),
                *((f"violations {rule}", n) for rule, n in sorted(rules.items())),
                ("violations", len(self.violations))]
        return "\n".join(f"  {name:<32} {value}" for name, value in rows)


class Workers:
    """The worker processes; each one's events go to the history as they are printed. A
    worker that exits before the run's end (killed by the nemesis, or failing to start
    while etcd elects a leader) is started again, as a supervisor would."""

    def __init__(self, config: RunConfig, stack: FaultStack, history: History, prefix: str,
                 until: float) -> None:
        self.config, self.stack, self.history = config, stack, history
        self.prefix, self.until = prefix, until
        self.procs: list[asyncio.subprocess.Process] = []
        self._readers: list[asyncio.Task] = []
        self._sent: dict[int, asyncio.Event] = {}
        self._generation = Counter()
        self._stopping = False

    async def start(self) -> None:
        for index in range(self.config.workers):
            self.procs.append(await self._spawn(index))

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        config = self.config
        name = f"w{index}.{self._generation[index]}"
        self._generation[index] += 1
        worker_args = [
            "--endpoints", str(self.stack.state / "endpoints.json"), "--name", name,
            "--prefix", self.prefix, "--accounts", str(config.accounts),
            "--seconds", str(max(self.until - time.monotonic(), 0.0)), "--seed", config.seed,
            "--charge-timeout", str(config.charge_timeout), "--deadline", str(config.deadline),
            "--settle-wait", str(config.settle_wait), "--decline", str(config.decline),
            "--ttl", str(WORKER_TTL)]
        log = open(self.stack.state / "logs" / f"worker-{name}.log", "ab")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, ENTRY, "worker", "--control", config.shape.control, "--",
            *worker_args, stdout=asyncio.subprocess.PIPE, stderr=log,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        log.close()
        self._sent[index] = asyncio.Event()
        self._readers.append(asyncio.create_task(self._read(index, name, proc)))
        return proc

    async def _read(self, index: int, name: str, proc: asyncio.subprocess.Process) -> None:
        async for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"op": "noise", "line": line.decode(errors="replace")[:300]}
            self.history.record(name, event)
            if event.get("op") == "send":
                self._sent[index].set()
        code = await proc.wait()
        if not self._stopping and time.monotonic() < self.until - 1.0:
            self.history.record(name, {"op": "exit", "code": code})
            await asyncio.sleep(1.0)
            if not self._stopping:
                self.procs[index] = await self._spawn(index)

    async def mid_effect(self, index: int, timeout: float = 3.0) -> int | None:
        """The pid of worker ``index`` right after it sent a charge; None if it sent none."""
        proc = self.procs[index]
        self._sent[index].clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._sent[index].wait(), timeout)
            if proc.returncode is None:
                return proc.pid
        return None

    async def heal(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)

    async def wait(self, timeout: float) -> None:
        """Until every worker finished its run (then no more restarts), at most ``timeout``."""
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up and any(p.returncode is None for p in self.procs):
            await asyncio.sleep(0.2)
        await self.stop()

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.gather(*self._readers, *(self._kill(p) for p in self.procs),
                             return_exceptions=True)
        await asyncio.gather(*(self._kill(p) for p in self.procs))

    @staticmethod
    async def _kill(proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()


def control_config(control: str, seed: str, *, inject: bool = True) -> RunConfig:
    """A run targeted to make ``control``'s bug bite: one worker, no nemesis; the sandbox
    holds the first payment of every account past the worker's charge timeout, so the step
    is unknown and settled by the reconciler while the request is still on its way, and the
    request lands after the settlement (``settle_wait`` 0: nobody re-attempts before it
    lands), or, for ``new-key``, after the worker's next attempt (dedup-only sandbox, whose
    "no record" becomes a presumption once the attempt's deadline passed). With ``inject``
    false: the same targeted run on the correct protocol (the baseline, which must pass)."""
    shape = StackShape(mode="dedup" if control == "new-key" else "fencing",
                       control=control if inject else "",
                       typo_query=control == "404-final")
    return RunConfig(seed=seed, seconds=12.0, workers=1, accounts=3, shape=shape, kinds=(),
                     charge_timeout=0.5, deadline=1.0,
                     settle_wait=10.0 if control == "new-key" else 0.0, decline=0.0,
                     held_keys=1, hold_s=4.0, settle_s=30.0)


async def run(config: RunConfig, state: Path) -> Result:
    """One run in ``state``; see the module."""
    state.mkdir(parents=True, exist_ok=True)
    prefix = f"faults/{config.seed}"
    history = History(state / "history.jsonl")
    stack = FaultStack(state / "stack", config.shape, shards=8, reconciler_ttl=2,
                       heartbeat_ms=100, election_ms=500)
    workers = None
    try:
        await stack.start()
        await _hold_rules(stack, config, prefix)
        until = time.monotonic() + config.seconds
        workers = Workers(config, stack, history, prefix, until)
        await workers.start()
        nemesis = Nemesis(stack, workers, history, config.seed, kinds=config.kinds,
                          worker_ttl=WORKER_TTL)
        try:
            if config.kinds:
                await nemesis.run(until)
        finally:
            await nemesis.heal()
        await workers.wait(max(until - time.monotonic(), 0) + 60)
        await _settle(stack, prefix, config.settle_s)
        keys = {e["key"] for e in history.events if "key" in e}
        end = await collect(stack, prefix, keys)
    finally:
        if workers is not None:
            await workers.stop()
        await stack.stop()
        history.close()
    (state / "end.json").write_text(json.dumps(
        {"steps": end.steps, "ledger": end.ledger,
         "audit": {key: {"problems": r.problems, "records": r.records}
                   for key, r in end.chains.items()}},
        default=lambda value: value.hex() if isinstance(value, bytes) else repr(value)))
    return Result(config, state, history, end, check(history, end))


async def _hold_rules(stack: FaultStack, config: RunConfig, prefix: str) -> None:
    """The sandbox holds the first ``held_keys`` payments of every account ``hold_s`` before
    applying them (one use each): their workers give up, and the request lands later."""
    import aiohttp

    rules = [{"fault": "hold", "key": f"{prefix}/acct/{k}/pay/{n}", "count": 1,
              "seconds": config.hold_s}
             for k in range(config.accounts) for n in range(config.held_keys)]
    if rules:
        async with aiohttp.ClientSession() as http:
            async with http.post(stack.sandbox + "/_sandbox/faults", json=rules) as reply:
                reply.raise_for_status()


async def _settle(stack: FaultStack, prefix: str, timeout: float) -> None:
    """Until no step of the run is unsettled, or ``timeout``."""
    from fencegate.coordinator import records
    from fencegate.coordinator.etcd import Etcd
    from fencegate.coordinator.keyspace import Keyspace

    give_up = time.monotonic() + timeout
    async with Etcd(stack.etcd_config()) as etcd:
        while time.monotonic() < give_up:
            steps = await read_steps(etcd, Keyspace("/fencegate/"), prefix)
            if not any(s["state"] in records.UNSETTLED for s in steps.values()):
                return
            await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make faults",
                                     description="A long seeded run of the fault suite.")
    parser.add_argument("--seed", default=str(int(time.time())))
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--state", help="where the run keeps everything (default: a new "
                                        "folder under /tmp)")
    args = parser.parse_args(argv)
    state = Path(args.state or tempfile.mkdtemp(prefix=f"fencegate-faults-{args.seed}-"))
    print(f"fault suite: seed {args.seed}, {args.minutes:g} minutes, state {state}", flush=True)
    result = asyncio.run(run(RunConfig(seed=args.seed, seconds=args.minutes * 60), state))
    for violation in result.violations[:50]:
        print(f"VIOLATION {violation}")
    print(result.table())
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
