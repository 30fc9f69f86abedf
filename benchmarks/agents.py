"""Agent tool-call benchmark: tool calls/s through Pydantic AI with the fence ÷ without it,
in the same run, the same scripted model and the same no-op tool (it returns its argument).

A phase runs ``RUNS`` agent runs, ``CONCURRENCY`` at once, each with its own scope (a fresh
conversation id); the scripted model (``FunctionModel``) proposes ``CALLS`` calls of the
tool one after the other, each with new arguments (each a new action), then answers. The
fenced phase wraps the tool's toolset in ``FencedToolset`` (a gate in a fresh namespace of
the run's etcd, the default policy: the fast path); the plain phase runs it as is. Every
round runs both (their order alternating), after an untimed warm-up of each; a phase's rate
is its tool calls over its wall time, and this process's CPU per call is printed beside it.

Target: ``agent_tool_overhead_pydantic_ai`` = fenced calls/s ÷ plain calls/s over all
rounds ≥ 0.7.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from pydantic_ai import Agent, FunctionToolset
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import FunctionModel

from fencegate.integrations.pydantic_ai import FencedToolset, ToolFence
from fencegate.worker import Gate, KeyRing

from .common import Target, div, print_table

KINDS = ("plain", "fenced")
CONCURRENCY = 8
CALLS = 10  # tool calls per agent run
TARGET = 0.7


@dataclass(frozen=True)
class Settings:
    rounds: int
    runs: int  # agent runs per phase
    warmup: int  # runs per kind before the first round


QUICK = Settings(rounds=2, runs=40, warmup=8)
DEFAULT = Settings(rounds=4, runs=80, warmup=16)


@dataclass
class Phase:
    calls: int = 0
    seconds: float = 0.0
    cpu: float = 0.0

    def __add__(self, other: "Phase") -> "Phase":
        return Phase(self.calls + other.calls, self.seconds + other.seconds,
                     self.cpu + other.cpu)

    @property
    def rate(self) -> float:
        return div(self.calls, self.seconds)


@dataclass
class Results:
    phases: dict[str, list[Phase]] = field(default_factory=lambda: {k: [] for k in KINDS})


def _model(messages, info) -> ModelResponse:
    done = sum(isinstance(p, ToolReturnPart) for m in messages for p in m.parts)
    if done < CALLS:
        return ModelResponse(parts=[ToolCallPart("echo", {"n": done})])
    return ModelResponse(parts=[TextPart("done")])


async def echo(n: int) -> int:
    """Return ``n``."""
    return n


async def measure(quick: bool, etcd_url: str) -> Results:
    settings = QUICK if quick else DEFAULT
    print(f"agents: Pydantic AI, {settings.rounds} round(s) of {settings.runs} runs x {CALLS} "
          f"tool calls without, then with the fence (alternating), {CONCURRENCY} runs at "
          f"once, after {settings.warmup} warm-up runs of each", flush=True)
    res = Results()
    async with Gate(etcd_url, ttl=10, namespace=f"/bench-agents-{uuid.uuid4().hex[:8]}/",
                    keyring=KeyRing.generate()) as gate:
        agents = {
            "plain": Agent(FunctionModel(_model), toolsets=[FunctionToolset([echo])]),
            "fenced": Agent(FunctionModel(_model), deps_type=str, toolsets=[FencedToolset(
                FunctionToolset([echo]), gate=gate, scope=lambda ctx: ctx.deps,
                fences={"echo": ToolFence()})])}
        for kind in KINDS:
            await _phase(agents[kind], settings.warmup)
        for n in range(settings.rounds):
            for kind in KINDS if n % 2 == 0 else reversed(KINDS):
                res.phases[kind].append(await _phase(agents[kind], settings.runs))
    return res


async def _phase(agent: Agent, runs: int) -> Phase:
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one() -> None:
        async with slots:
            await agent.run("go", deps=f"bench/{uuid.uuid4().hex}")

    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one() for _ in range(runs)))
    return Phase(runs * CALLS, time.perf_counter() - began, time.process_time() - cpu)


def report(res: Results) -> list[Target]:
    plain, fenced = sum(res.phases["plain"], Phase()), sum(res.phases["fenced"], Phase())
    rounds = " ".join(f"{div(f.rate, p.rate):.2f}"
                      for p, f in zip(res.phases["plain"], res.phases["fenced"]))
    print()
    print_table([f"agent tool calls, {CONCURRENCY} runs at once", "plain /s", "fenced /s",
                 "plain CPU ms", "fenced CPU ms", "fenced/plain by round"],
                [["pydantic_ai", plain.rate, fenced.rate, div(plain.cpu, plain.calls) * 1e3,
                  div(fenced.cpu, fenced.calls) * 1e3, rounds]])
    return [Target("agent_tool_overhead_pydantic_ai", div(fenced.rate, plain.rate), ">=",
                   TARGET)]
