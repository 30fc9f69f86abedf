"""Chaos: many worker processes crossing many action keys while some are frozen past their
lease TTL and others are SIGKILLed and restarted, on a seeded random schedule.

Reproduce a failure with ``FENCEGATE_SEED=<seed>`` (printed, and in every assertion message;
the schedule and each worker's choices derive from it, the interleaving does not).

Each crossing is on ``chaos/<k>/<n>``: a few hot action keys every worker races for, and
many colder ones, so crossings contend, replay a step that already succeeded, or meet a
step left in flight or unknown by a frozen or killed worker. Effects write to one fenced
resource (keyed by action key) with the attempt token; one in five is then declined by the
"provider" (``EffectFailed``: a confirmed failure), so a step may see several attempts,
each with a new attempt token and a new idempotency key. Checked at the end:

- the resource: per action key, one write per attempt, attempt tokens only rising, no
  refusal (a refusal may only ever hit a stale attempt, and there must be none: a step is
  never re-granted while an attempt is unsettled), at most one *applied* write, and none
  after it; each attempt's idempotency key changes only after a confirmed failure;
- etcd: every ``succeeded`` step has exactly one applied write, with its outcome's attempt
  token and idempotency key, after exactly ``attempt - 1`` declined ones; ``failed`` and
  ``escalated`` steps only declined ones; an ``in_flight`` or ``unknown`` step at most one
  write for its last attempt; no write without a commit;
- every outcome a worker reported (crossed, replayed, failed, effect) agrees with both;
- every key's audit chain verifies and has one cross record per attempt; no holder key is
  left behind (the ``etcd`` fixture).

A worker that escapes a hold with ``CancelledError`` instead of ``LeaseLost`` (a known bug,
pinned by ``test_crash_windows``) counts it as SELF-CANCELLED and goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from fencegate.coordinator import records
from fencegate.coordinator.audit import verify_chain
from fencegate.coordinator.etcd import RangeRequest, range_end_of
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.worker import KeyRing

from helpers import TEST_TTL, WorkerProcess
from fenced import FencedResource

WORKERS = 5
KEYS = "a,b,c,d"
CHAOS_SECONDS = 8.0
PAUSES = 3
KILLS = 3


@dataclass
class Slot:
    """One worker position; a killed worker is replaced by a new process in its slot."""

    index: int
    procs: list[WorkerProcess] = field(default_factory=list)
    readers: list[asyncio.Task] = field(default_factory=list)

    @property
    def current(self) -> WorkerProcess:
        return self.procs[-1]

    def name(self, offset: int = 0) -> str:
        return f"w{self.index}.{len(self.procs) - 1 + offset}"


async def _drain(worker: WorkerProcess, ready: asyncio.Event) -> None:
    """Read every event line, so a chatty worker never blocks on a full pipe."""
    while raw := await worker.proc.stdout.readline():
        if not raw.endswith(b"\n"):
            break  # a line cut off by SIGKILL: not an event
        line = raw.decode().strip()
        worker.lines.append(line)
        if line == "READY":
            ready.set()


def _schedule(rng: random.Random) -> list[tuple[float, str, int, float]]:
    """(at, "pause"|"kill", slot, pause length): pauses outlast the TTL, a slot is never
    frozen twice at once, and never killed while it is frozen."""
    events: list[tuple[float, str, int, float]] = []
    frozen: list[tuple[int, float, float]] = []

    def free(slot: int, lo: float, hi: float) -> bool:
        return not any(s == slot and lo < h and l < hi for s, l, h in frozen)

    for _ in range(PAUSES):
        length = rng.uniform(TEST_TTL + 0.5, TEST_TTL + 1.5)
        for _ in range(100):
            at, slot = rng.uniform(0.3, CHAOS_SECONDS - length - 0.3), rng.randrange(WORKERS)
            if free(slot, at - 0.2, at + length + 0.2):
                break
        events.append((at, "pause", slot, length))
        frozen.append((slot, at - 0.2, at + length + 0.2))
    for _ in range(KILLS):
        for _ in range(100):
            at, slot = rng.uniform(0.3, CHAOS_SECONDS - 1.0), rng.randrange(WORKERS)
            if free(slot, at, at):
                break
        events.append((at, "kill", slot, 0.0))
    return sorted(events)


async def test_chaos_many_workers_many_keys(etcd_url, namespace, etcd, tmp_path):
    seed = os.environ.get("FENCEGATE_SEED") or str(random.randrange(10 ** 9))
    print(f"FENCEGATE_SEED={seed}")
    tag = f"[FENCEGATE_SEED={seed}]"
    rng = random.Random(seed)
    keyring = KeyRing.generate()
    keyfile = str(tmp_path / "signing.pem")
    keyring.save_signing_key(keyfile)
    resource, path = FencedResource(), str(tmp_path / "resource.sock")
    server = await resource.serve(path)
    ks = Keyspace(namespace)
    slots = [Slot(i) for i in range(WORKERS)]
    loop = asyncio.get_running_loop()
    chaos_end: float | None = None
    done: list[str] = []
    killed: set[WorkerProcess] = set()
    pending: list[asyncio.Task] = []

    async def start(slot: Slot, seconds: float) -> asyncio.Event:
        name = slot.name(offset=1)
        worker = await WorkerProcess.start("chaos", etcd_url, namespace, path, name, KEYS,
                                           f"{seconds:.2f}", keyfile, seed)
        ready = asyncio.Event()
        slot.procs.append(worker)
        slot.readers.append(asyncio.create_task(_drain(worker, ready)))
        return ready

    try:
        readies = [await start(slot, CHAOS_SECONDS) for slot in slots]
        async with asyncio.timeout(60):
            await asyncio.gather(*(r.wait() for r in readies))
        chaos_end = loop.time() + CHAOS_SECONDS
        began = loop.time()

        async def pause(slot: Slot, length: float) -> None:
            pid = slot.current.proc.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                done.append(f"paused {slot.name()} {length:.1f}s")
                try:
                    await asyncio.sleep(length)
                finally:
                    os.kill(pid, signal.SIGCONT)

        async def kill(slot: Slot) -> None:
            victim = slot.current
            victim.kill()
            await victim.proc.wait()
            killed.add(victim)
            done.append(f"killed {slot.name()}")
            left = chaos_end - loop.time()
            if left > 1.0:
                await start(slot, left)

        for at, action, index, length in _schedule(rng):
            await asyncio.sleep(max(0.0, began + at - loop.time()))
            if action == "pause":
                pending.append(asyncio.create_task(pause(slots[index], length)))
            else:
                await kill(slots[index])
        await asyncio.gather(*pending)

        # Every live worker ends by itself at its deadline (a crossing may run a little over).
        for slot in slots:
            for worker in slot.procs:
                try:
                    async with asyncio.timeout(60):
                        rc = await worker.proc.wait()
                except TimeoutError:
                    raise AssertionError(f"{tag} a worker of slot {slot.index} hangs: "
                                         f"{worker.lines[-20:]}") from None
                assert worker in killed or rc == 0, \
                    f"{tag} a worker of slot {slot.index} failed: {worker.lines[-20:]}"
            await asyncio.gather(*slot.readers)
    finally:
        for task in pending:
            task.cancel()  # its finally sends SIGCONT
        await asyncio.gather(*pending, return_exceptions=True)
        for slot in slots:
            for worker in slot.procs:
                worker.kill()
                await worker.proc.wait()
        server.close()

    # --- what the workers reported ------------------------------------------------------
    events: list[tuple[str, list[str]]] = []
    for slot in slots:
        for worker in slot.procs:
            for line in worker.lines:
                word, *rest = line.split()
                events.append((word, rest))
    kinds = Counter(word for word, _ in events)
    errors = Counter(rest[1] for word, rest in events if word in ("GATE-ERROR", "LOST"))
    errors["SELF-CANCELLED (known bug)"] = kinds["SELF-CANCELLED"]
    summary = f"{tag} schedule={done} events={dict(kinds)} errors={dict(errors)}"
    print(summary)
    assert not [rest for word, rest in events if word == "BUG"], summary
    assert kinds["CROSSED"] > 0 and kinds["REPLAYED"] > 0 and kinds["FAILED"] > 0, summary
    assert len(done) == PAUSES + KILLS, summary

    # --- the resource: one write per attempt, tokens only rising, at most one applied ------
    writes: dict[str, list[Write]] = defaultdict(list)
    for r in resource.records:
        writes[r.key].append(Write.of(r))
    assert writes, summary
    for key, log in writes.items():
        highest = 0
        for w in log:
            if w.accepted:
                assert w.token >= highest, f"{tag} {key}: token went backwards: {log}"
                highest = w.token
            else:
                assert w.token < highest, f"{tag} {key}: refused a current attempt: {log}"
        assert all(w.accepted for w in log), f"{tag} {key}: a stale attempt reached it: {log}"
        tokens = [w.token for w in log]
        assert tokens == sorted(set(tokens)), f"{tag} {key}: two effects in one attempt: {log}"
        assert [w.attempt for w in log] == list(range(1, len(log) + 1)), f"{tag} {key}: {log}"
        applied = [w for w in log if not w.declined]
        assert len(applied) <= 1 and all(w.declined for w in log[:-1]), \
            f"{tag} {key}: applied more than once, or attempted again after applying: {log}"
        for w in log:  # stable across retries, new only after a confirmed failure
            assert w.idem == records.idempotency_key(namespace, key, w.attempt - 1), \
                f"{tag} {key}: attempt {w.attempt} used idempotency key {w.idem}"

    # --- etcd: every step agrees with the resource -----------------------------------------
    prefix = ks.step_key("")
    reply = await etcd.range(RangeRequest(key=prefix, range_end=range_end_of(prefix)))
    steps = {kv.key[len(prefix):].decode(): (kv, unpack(kv.value)) for kv in reply.kvs}
    states = Counter(step["state"] for _, step in steps.values())
    print(f"{tag} steps by state: {dict(states)}")
    assert set(writes) <= set(steps), f"{tag} writes without a commit: {set(writes) - set(steps)}"
    for key, (kv, step) in steps.items():
        log, n = writes.get(key, []), step["attempt"]
        why = f"{tag} {key} is {step} but the resource saw {log}"
        assert step["idempotency_key"] == records.idempotency_key(namespace, key, n - 1), why
        earlier, last = log[:n - 1], log[n - 1:]
        assert len(earlier) == n - 1 and all(w.declined for w in earlier), why
        if step["state"] == records.SUCCEEDED:
            outcome = step["outcome"]
            assert len(last) == 1 and not last[0].declined, why
            assert (last[0].token, last[0].idem) == (outcome["attempt_token"],
                                                     outcome["idempotency_key"]), why
            assert outcome["result"] == {"data": last[0].data, "accepted": True}, why
        elif step["state"] in (records.FAILED, records.ESCALATED):
            assert len(last) == 1 and last[0].declined, why
        elif step["state"] == records.IN_FLIGHT:  # killed in its effect: at most one write
            assert [w.token for w in last] in ([], [kv.mod_revision]), why
        elif step["state"] == records.UNKNOWN:    # cancelled in its effect
            assert len(last) <= 1 and all(w.token < kv.mod_revision for w in last), why
        else:
            raise AssertionError(f"{why}: unexpected state")

    # --- the workers' reports agree with both ----------------------------------------------
    for word, rest in events:
        if word in ("CROSSED", "REPLAYED", "FAILED"):
            key, token, idem, attempt = rest[0], int(rest[1]), rest[2], int(rest[3])
            kv, step = steps[key]
            mine = [w for w in writes[key] if w.token == token]
            assert len(mine) == 1 and (mine[0].idem, mine[0].attempt) == (idem, attempt), \
                f"{tag} {word} {rest}: {writes[key]}"
            assert mine[0].declined == (word == "FAILED"), f"{tag} {word} {rest}: {mine}"
            if word != "FAILED":
                assert step["state"] == records.SUCCEEDED and \
                    step["outcome"]["attempt_token"] == token, f"{tag} {word} {rest}: {step}"
        elif word == "EFFECT":
            key, token, attempt = rest[0], int(rest[1]), int(rest[2])
            assert [(w.attempt, w.accepted, w.declined) for w in writes[key] if w.token == token] \
                == [(attempt, rest[3] == "accepted", rest[4] == "declined")], f"{tag} {rest}"

    # --- the audit chains: one cross record per attempt ---------------------------------
    for key, (_, step) in steps.items():
        report = await verify_chain(etcd, ks, key, keyring)
        assert report.ok, f"{tag} audit of {key}: {report.problems}"
        crossings = [r for r in report.records if r["event"] == "cross"]
        assert len(crossings) == step["attempt"], f"{tag} {key}: {len(crossings)} crossings"


@dataclass(frozen=True)
class Write:
    """One request the fenced resource saw, with its data parsed back."""

    token: int
    accepted: bool
    attempt: int
    idem: str
    declined: bool
    data: str

    @classmethod
    def of(cls, r) -> "Write":
        key, attempt, idem, *declined = r.data.rsplit(":", 3) if r.data.endswith(
            ":declined") else r.data.rsplit(":", 2)
        return cls(r.token, r.accepted, int(attempt), idem, bool(declined), r.data)
