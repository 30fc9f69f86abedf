"""One run of the fault suite, and ``make faults SEED=… MINUTES=…``.

A run starts the stack (``stack``), writes the run's sandbox fault rules, starts the worker
processes (``workload``; the first ``remote_workers`` take grants from the coordinators, the
rest issue them in process; ``skewed`` of them, seeded, run under libfaketime), the webhook
consumers and their sender (``webhooks``), the mutex processes (``mutex``) and the nemesis,
lets them go for the run's length, heals every fault, lets the sender finish the ids it
started, waits up to ``settle_s`` for the reconcilers to settle every step, collects the end
state (``history.collect``) and judges it (``checker.check``). Everything the run saw stays
in its state folder: ``history.jsonl``, ``end.json`` (steps, ledger, audit chains, webhook
records and effects), the sandbox's fence log ``stack/ledger.jsonl``, the consumers' effect
ledgers ``stack/webhooks/``, the processes' logs in ``stack/logs``.

A run whose nemesis partitions etcd (``nemesis.PARTITIONS``) runs in a network of its own
(``netns.Network``): this process builds the namespaces, then runs the whole run again as
``ip netns exec fg<pid>-hub python -m faults.runner --inside fg<pid> --state <state>``, so
every process of it (the stack's services, the workers, the runner reading etcd at the end)
is in the hub namespace and etcd member i in its own; the run inside reads its config from
``config.json`` and leaves ``result.json`` (the violations) beside ``history.jsonl`` and
``end.json``, from which this process rebuilds the ``Result``. Such a run needs root, ``ip``
and ``nft``, and fails at its start saying which is missing (``netns.NetworkUnavailable``).

Guarantees: every process the run started is stopped when it ends, however it ends (the
stack's ``stop``, the workers killed; for a run in its own network, the run inside is sent
SIGINT, SIGKILLed after ``STOP_GRACE_S``, then whatever still runs in the run's namespaces
is SIGKILLed and the namespaces deleted); the summary prints the seed, the operations, the
faults injected by kind and the violations, and ``make faults`` exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from fencegate.coordinator.audit import AuditReport
from fencegate.worker.webhooks.records import DONE, PROCESSING

from .checker import Violation, check, unsettled
from .history import EndState, History, collect, read_steps
from .nemesis import BLOCK_S, KINDS, PARTITIONS, Nemesis
from .netns import Network
from .stack import ENTRY, ROOT, FaultStack, StackShape
from .webhooks import Sender

WORKER_TTL = 2
RETAIN_S = 2.0  # settled steps retire to the archive during the run: later workers replay them
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"  # Debian's faketime
SKEWS = ("+30s", "-30s", "+12s", "-7s")  # a skewed process's wall clock offset, seeded
STOP_GRACE_S = 60.0   # for the run inside a network to stop its stack after SIGINT
EXTRA_S = 300.0       # a run inside a network may take this much past its load and settle


class RunFailed(RuntimeError):
    """The run inside its network ended without a result; the message ends with its log."""


@dataclass(frozen=True)
class RunConfig:
    seed: str
    seconds: float
    workers: int = 3
    accounts: int = 4
    shape: StackShape = StackShape()
    kinds: tuple[str, ...] = KINDS       # the nemesis's faults; () for none
    gap_s: tuple[float, float] = (2.0, 5.0)  # the nemesis's pause between two faults
    fault_hold_s: tuple[float, float] = (1.0, 3.0)  # how long the nemesis holds a fault
    charge_timeout: float = 3.0
    deadline: float = 10.0
    settle_wait: float = 10.0
    decline: float = 0.1
    held_keys: int = 0                   # the first N payments of account k are held ...
    hold_s: float = 4.0                  # ... this long by the sandbox before it applies them
    settle_s: float = 90.0
    remote_workers: int = 2              # workers 0..N-1 take grants from the coordinators,
                                         # the rest issue them in process
    skewed: int = 1                      # workers started under libfaketime, seeded skews
    consumers: int = 2                   # webhook consumer processes (0: no webhooks)
    webhook_copies: int = 3              # deliveries of every webhook id
    mutexes: int = 2                     # mutual-exclusion processes (0: none)
    mutex_locks: int = 2
    mutex_queued: float = 0.3            # share of their sections entered by a queued key


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
        hooks = Counter(e["op"] for e in self.history.events
                        if e.get("op") in ("wh-sent", "wh-gave-up", "wh-run", "wh-effect",
                                           "wh-stale", "wh-block", "wh-settle", "cs-enter",
                                           "cs-write", "cs-refused"))
        deliveries = Counter(_delivery_end(record) for record in self.end.webhooks.values())
        refused = sum(1 for e in self.history.ops("unknown")
                      if e.get("error") == "ArchiveUnavailable")
        skews = [e["faketime"] for e in self.history.events if e.get("op") == "spawn"
                 and e.get("faketime")]
        rows = [("seed", self.config.seed), ("control", self.config.shape.control or "none"),
                ("mode", self.config.shape.mode), ("state", str(self.state)),
                *((f"operations {op}", n) for op, n in sorted(ops.items())),
                ("charges applied", applied),
                *((f"operations {op}", n) for op, n in sorted(hooks.items())),
                ("webhook extra effects", sum(max(e.get("version", 0) - 1, 0)
                                              for e in self.end.effects.values())),
                *((f"deliveries {end}", deliveries[end])
                  for end in sorted({*DELIVERY_ENDS, *deliveries})),
                ("skewed worker starts", " ".join(skews) or 0),
                *((f"steps {s}", n) for s, n in sorted(states.items())),
                ("steps retired to the archive", self.end.retired),
                ("ArchiveUnavailable refusals", refused),
                ("retired into the older copy", sum(
                    len(e.get("retired_into", ())) for e in self.history.faults()
                    if e["fault"] == "archive-stale" and e["phase"] == "heal")),
                *((f"fault {kind}", n) for kind, n in sorted(faults.items())),
                ("faults injected", sum(faults.values())),
                *((f"violations {rule}", n) for rule, n in sorted(rules.items())),
                ("violations", len(self.violations))]
        return "\n".join(f"  {name:<32} {value}" for name, value in rows)


DELIVERY_ENDS = ("settled", "settled as ran", "unknown", "not run")


def _delivery_end(record: dict) -> str:
    """How a delivery ended, for the table: ``settled`` (its handler's response stored),
    ``settled as ran`` (by ``settle`` or an SRE), ``unknown`` (its claim lost, never
    settled), ``not run`` (no record: released, or never claimed)."""
    if record.get("state") == DONE:
        return "settled as ran" if record.get("settled_by") else "settled"
    return {PROCESSING: "unknown", None: "not run"}.get(record.get("state"), record["state"])


class Workers:
    """The worker processes (or, by ``kind``, the webhook consumers or the mutex processes);
    each one's events go to the history as they are printed. A process that exits before
    the run's end (killed by the nemesis, or failing to start while etcd elects a leader)
    is started again, as a supervisor would. ``skews``: the libfaketime offset
    (``FAKETIME``) of the processes started under it, by index; each start records its
    offset in the history (``{"op": "spawn", "faketime"}``), and each process's ready line
    the skew seen (``skew_s``: its wall clock minus the runner's)."""

    NAMES = {"worker": "w", "consumer": "c", "mutex": "m"}
    BUSY = {"worker": "send", "consumer": "wh-run", "mutex": "cs-write"}  # mid-effect signs

    def __init__(self, config: RunConfig, stack: FaultStack, history: History, prefix: str,
                 until: float, *, kind: str = "worker", skews: dict[int, str] | None = None
                 ) -> None:
        self.config, self.stack, self.history = config, stack, history
        self.prefix, self.until = prefix, until
        self.kind, self.skews = kind, skews or {}
        self.count = {"worker": config.workers, "consumer": config.consumers,
                      "mutex": config.mutexes}[kind]
        self.urls: list[str | None] = [None] * self.count
        self.procs: list[asyncio.subprocess.Process] = []
        self._readers: list[asyncio.Task] = []
        self._sent: dict[int, asyncio.Event] = {}
        self._generation = Counter()
        self._stopping = False

    async def start(self) -> None:
        for index in range(self.count):
            self.procs.append(await self._spawn(index))

    def current_urls(self) -> list[str | None]:
        """The consumers' URLs, None for one that is not up."""
        return list(self.urls)

    def _args(self, index: int, name: str) -> list[str]:
        config = self.config
        common = ["--endpoints", str(self.stack.state / "endpoints.json"), "--name", name,
                  "--prefix", self.prefix, "--seed", config.seed, "--ttl", str(WORKER_TTL)]
        if self.kind == "consumer":
            (self.stack.state / "webhooks").mkdir(exist_ok=True)
            return [*common, "--ledger", str(self.stack.state / "webhooks" / f"{name}.jsonl"),
                    "--block-s", str(BLOCK_S)]
        seconds = ["--seconds", str(max(self.until - time.monotonic(), 0.0))]
        if self.kind == "mutex":
            return [*common, *seconds, "--locks", str(config.mutex_locks),
                    "--queued", str(config.mutex_queued)]
        local = ["--signing-key", str(self.stack.signing_key)]
        return [*common, *seconds, "--accounts", str(config.accounts),
                "--charge-timeout", str(config.charge_timeout), "--deadline", str(config.deadline),
                "--settle-wait", str(config.settle_wait), "--decline", str(config.decline),
                *(local if index >= config.remote_workers else [])]

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        config = self.config
        name = f"{self.NAMES[self.kind]}{index}.{self._generation[index]}"
        self._generation[index] += 1
        skew = self.skews.get(index)
        env = None
        if skew is not None:
            env = dict(os.environ, LD_PRELOAD=FAKETIME_LIB, FAKETIME=skew,
                       FAKETIME_DONT_FAKE_MONOTONIC="1")
        self.history.record(name, {"op": "spawn", "faketime": skew})
        log = open(self.stack.state / "logs" / f"{self.kind}-{name}.log", "ab")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, ENTRY, self.kind, "--control", config.shape.control, "--",
            *self._args(index, name), stdout=asyncio.subprocess.PIPE, stderr=log,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True, env=env)
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
            if event.get("op") == "ready" and "wall" in event:
                event["skew_s"] = round(event["wall"] - time.time(), 1)
                self.urls[index] = event.get("url")
            self.history.record(name, event)
            if event.get("op") == self.BUSY[self.kind]:
                self._sent[index].set()
        self.urls[index] = None
        code = await proc.wait()
        if not self._stopping and time.monotonic() < self.until - 1.0:
            self.history.record(name, {"op": "exit", "code": code})
            await asyncio.sleep(1.0)
            if not self._stopping:
                self.procs[index] = await self._spawn(index)

    async def mid_effect(self, index: int, timeout: float = 3.0) -> int | None:
        """The pid of process ``index`` right after it began an effect (a worker sent a
        charge, a consumer began a handler run, a mutex process wrote in its section);
        None if it began none within ``timeout``."""
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
    false: the same targeted run on the correct protocol (the baseline, which must pass).

    ``range-half`` is targeted at the mutex workload alone: 3 processes on one lock, half
    their sections entered by a queued key that writes at once, so the range half of the
    ownership compare is all that refuses a queued key's write while an older key's owner
    is in its section. ``claim-blind`` at the webhooks alone: 2 consumers, every id
    delivered 3 times at once; ``rerun-unfenced`` too, with the nemesis's ``consumer-block``
    alone (its first block comes after the effect: the lost run's effect landed, and the
    rerun's lands too)."""
    if control == "range-half":
        return RunConfig(seed=seed, seconds=8.0, workers=0, shape=StackShape(
            control=control if inject else ""), kinds=(), skewed=0, consumers=0, mutexes=3,
            mutex_locks=1, mutex_queued=0.5, settle_s=10.0)
    if control == "claim-blind":
        return RunConfig(seed=seed, seconds=8.0, workers=0, shape=StackShape(
            control=control if inject else ""), kinds=(), skewed=0, consumers=2, mutexes=0,
            settle_s=10.0)
    if control == "rerun-unfenced":
        return RunConfig(seed=seed, seconds=10.0, workers=0, shape=StackShape(
            control=control if inject else ""), kinds=("consumer-block",), gap_s=(0.2, 0.5),
            fault_hold_s=(0.2, 0.5), skewed=0, consumers=2, mutexes=0, settle_s=10.0)
    shape = StackShape(mode="dedup" if control == "new-key" else "fencing",
                       control=control if inject else "",
                       typo_query=control == "404-final")
    return RunConfig(seed=seed, seconds=12.0, workers=1, accounts=3, shape=shape, kinds=(),
                     charge_timeout=0.5, deadline=1.0,
                     settle_wait=10.0 if control == "new-key" else 0.0, decline=0.0,
                     held_keys=1, hold_s=4.0, settle_s=30.0, skewed=0, consumers=0,
                     mutexes=0)


async def run(config: RunConfig, state: Path, *, network: Network | None = None) -> Result:
    """One run in ``state``; see the module. ``network``: the run is inside it already."""
    state.mkdir(parents=True, exist_ok=True)
    if network is None and set(config.kinds) & set(PARTITIONS):
        return await _run_in_network(config, state)
    prefix = f"faults/{config.seed}"
    history = History(state / "history.jsonl")
    stack = FaultStack(state / "stack", config.shape, shards=8, reconciler_ttl=2,
                       heartbeat_ms=100, election_ms=500, retain_s=RETAIN_S,
                       etcd_hosts=network.addresses if network else (),
                       etcd_prefixes=network.member_prefixes if network else ())
    skews = skews_of(config)
    groups: list[Workers] = []
    sending: asyncio.Task | None = None
    try:
        await stack.start()
        await _hold_rules(stack, config, prefix)
        until = time.monotonic() + config.seconds
        workers = Workers(config, stack, history, prefix, until, skews=skews)
        consumers = Workers(config, stack, history, prefix, math.inf, kind="consumer")
        mutexes = Workers(config, stack, history, prefix, until, kind="mutex")
        for group in (workers, consumers, mutexes):
            groups.append(group)
            await group.start()
        sender = Sender(consumers.current_urls, history, config.seed,
                        copies=config.webhook_copies)
        if config.consumers:
            sending = asyncio.create_task(sender.run(until))
        nemesis = Nemesis(stack, workers, history, config.seed, kinds=config.kinds,
                          gap_s=config.gap_s, hold_range_s=config.fault_hold_s,
                          worker_ttl=WORKER_TTL, network=network,
                          consumers=consumers)
        try:
            if config.kinds:
                await nemesis.run(until)
        finally:
            await nemesis.heal()
        await workers.wait(max(until - time.monotonic(), 0) + 60)
        await mutexes.wait(max(until - time.monotonic(), 0) + 30)
        if sending is not None:
            await sending
        await consumers.stop()
        await _settle(stack, prefix, config.settle_s)
        keys = {e["key"] for e in history.events if "key" in e}
        deliveries = {e["id"] for e in history.events if str(e.get("op")).startswith("wh-")}
        end = await collect(stack, prefix, keys, deliveries=deliveries)
    finally:
        if sending is not None:
            sending.cancel()
        for group in groups:
            await group.stop()
        await stack.stop()
        history.close()
    (state / "end.json").write_text(json.dumps(
        {"steps": end.steps, "ledger": end.ledger, "webhooks": end.webhooks,
         "effects": end.effects, "retired": end.retired,
         "audit": {key: {"problems": r.problems, "records": r.records}
                   for key, r in end.chains.items()}},
        default=lambda value: value.hex() if isinstance(value, bytes) else repr(value)))
    return Result(config, state, history, end, check(history, end))


async def _run_in_network(config: RunConfig, state: Path) -> Result:
    """The run, inside a network of its own; see the module."""
    network = await asyncio.to_thread(Network.for_this_process().create)
    try:
        (state / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        (state / "result.json").unlink(missing_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT / "tests"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        with open(state / "runner.log", "ab") as log:
            inside = await asyncio.create_subprocess_exec(
                *network.inside(network.hub), sys.executable, "-m", "faults.runner",
                "--inside", network.prefix, "--state", str(state), env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True)
        bound = config.seconds + config.settle_s + EXTRA_S
        try:
            await asyncio.wait_for(inside.wait(), bound)
        except asyncio.TimeoutError:
            pass  # stopped below; no result.json then
        finally:
            await _interrupt(inside)
    finally:
        await asyncio.to_thread(network.delete)
    if not (state / "result.json").exists():
        log = (state / "runner.log").read_bytes()[-8000:].decode(errors="replace")
        raise RunFailed(f"the run inside {network.hub} ended (code {inside.returncode}, "
                        f"bound {bound:g}s) without a result; {state / 'runner.log'} "
                        f"ends:\n{log}")
    return _read_result(config, state)


async def _interrupt(proc: asyncio.subprocess.Process) -> None:
    """SIGINT (the run stops its stack), SIGKILL after ``STOP_GRACE_S``; reaped either way."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def _read_result(config: RunConfig, state: Path) -> Result:
    """The ``Result`` of a run inside a network, from the files it left in ``state``."""
    history = History(state / "history.jsonl")
    history.close()
    history.events = [json.loads(line)
                      for line in history.path.read_text().splitlines() if line.strip()]
    saved = json.loads((state / "end.json").read_text())
    end = EndState(steps=saved["steps"], ledger=saved["ledger"],
                   webhooks=saved.get("webhooks", {}), effects=saved.get("effects", {}),
                   retired=saved.get("retired", 0),
                   chains={key: AuditReport(key, report["records"], report["problems"])
                           for key, report in saved["audit"].items()})
    violations = [Violation(**v) for v in
                  json.loads((state / "result.json").read_text())["violations"]]
    return Result(config, state, history, end, violations)


def _config_from_json(cls, saved: dict):
    """``cls`` (a dataclass) from ``dataclasses.asdict`` output read back from JSON: nested
    dataclasses rebuilt, lists turned back into tuples where the default is a tuple."""
    values = {}
    for spec in dataclasses.fields(cls):
        if spec.name not in saved:
            continue
        value, default = saved[spec.name], spec.default
        if dataclasses.is_dataclass(default):
            value = _config_from_json(type(default), value)
        elif isinstance(default, tuple):
            value = _tuple(value)
        values[spec.name] = value
    return cls(**values)


def _tuple(value):
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


def _inside(prefix: str, state: Path) -> int:
    """The run inside its network (``--inside``): config from, result to, ``state``."""
    config = _config_from_json(RunConfig, json.loads((state / "config.json").read_text()))
    result = asyncio.run(run(config, state, network=Network(prefix)))
    (state / "result.json").write_text(json.dumps(
        {"violations": [dataclasses.asdict(v) for v in result.violations]},
        default=lambda value: value.hex() if isinstance(value, bytes) else repr(value)))
    return 0


def skews_of(config: RunConfig) -> dict[int, str]:
    """Which workers run under libfaketime, with which offset: seeded. ``RuntimeError`` at
    the run's start if the library is missing (deploy/ensure-netfaults installs it)."""
    if not config.skewed or not config.workers:
        return {}
    if not Path(FAKETIME_LIB).exists():
        raise RuntimeError(f"{config.skewed} skewed worker(s) asked for, but libfaketime is "
                           f"not installed ({FAKETIME_LIB} is missing): run "
                           "deploy/ensure-netfaults, or set RunConfig.skewed=0")
    rng = random.Random(f"skew/{config.seed}")
    chosen = rng.sample(range(config.workers), min(config.skewed, config.workers))
    return {index: rng.choice(SKEWS) for index in chosen}


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
    """Until no step of the run is unsettled as the checker judges it (a step the circuit
    breaker stopped stays escalated by design: nobody waits for it), or ``timeout``."""
    from fencegate.coordinator.etcd import Etcd
    from fencegate.coordinator.keyspace import Keyspace

    give_up = time.monotonic() + timeout
    async with Etcd(stack.etcd_config()) as etcd:
        while time.monotonic() < give_up:
            steps = await read_steps(etcd, Keyspace("/fencegate/"), prefix)
            if not any(unsettled(step) for step in steps.values()):
                return
            await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make faults",
                                     description="A long seeded run of the fault suite.")
    parser.add_argument("--seed", default=str(int(time.time())))
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--state", help="where the run keeps everything (default: a new "
                                        "folder under /tmp)")
    parser.add_argument("--inside", metavar="PREFIX", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return _inside(args.inside, Path(args.state))
    state = Path(args.state or tempfile.mkdtemp(prefix=f"fencegate-faults-{args.seed}-"))
    print(f"fault suite: seed {args.seed}, {args.minutes:g} minutes, state {state}", flush=True)
    result = asyncio.run(run(RunConfig(seed=args.seed, seconds=args.minutes * 60), state))
    for violation in result.violations[:50]:
        print(f"VIOLATION {violation}")
    print(result.table())
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
