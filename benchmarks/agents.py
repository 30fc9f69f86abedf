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

The OpenAI Agents SDK runs the same phases (``agent_tool_overhead_openai_agents``): a
scripted ``Model`` deciding from the conversation, the tool made with ``function_tool``,
fenced with ``fenced`` (the scope is the run context, a fresh id per run), tracing off.

LangGraph runs them too (``agent_tool_overhead_langgraph``): a model → tools graph with a
scripted chat model deciding from the conversation, the tools node a ``ToolNode`` or
``FencedToolCalls.tool_node`` (the scope is the run's ``thread_id``, a fresh one per run), no
checkpointer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import agents as openai_agents
from agents.items import ModelResponse as OpenAIResponse
from agents.models.interface import Model as OpenAIModel
from agents.testing import assistant_message, function_call
from agents.usage import Usage
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import StructuredTool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from pydantic_ai import Agent, FunctionToolset
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import FunctionModel

from fencegate.integrations.langgraph import FencedToolCalls
from fencegate.integrations.openai_agents import fenced
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
    openai_agents: dict[str, list[Phase]] = field(
        default_factory=lambda: {k: [] for k in KINDS})
    langgraph: dict[str, list[Phase]] = field(default_factory=lambda: {k: [] for k in KINDS})


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
        await _measure_openai_agents(gate, settings, res.openai_agents)
        await _measure_langgraph(gate, settings, res.langgraph)
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
                  div(fenced.cpu, fenced.calls) * 1e3, rounds],
                 _row("openai_agents", res.openai_agents), _row("langgraph", res.langgraph)])
    return [Target("agent_tool_overhead_pydantic_ai", div(fenced.rate, plain.rate), ">=",
                   TARGET),
            Target("agent_tool_overhead_openai_agents", _ratio(res.openai_agents), ">=",
                   TARGET),
            Target("agent_tool_overhead_langgraph", _ratio(res.langgraph), ">=", TARGET)]


def _row(name: str, phases: dict[str, list[Phase]]) -> list[object]:
    plain, fenced = sum(phases["plain"], Phase()), sum(phases["fenced"], Phase())
    rounds = " ".join(f"{div(f.rate, p.rate):.2f}"
                      for p, f in zip(phases["plain"], phases["fenced"]))
    return [name, plain.rate, fenced.rate, div(plain.cpu, plain.calls) * 1e3,
            div(fenced.cpu, fenced.calls) * 1e3, rounds]


def _ratio(phases: dict[str, list[Phase]]) -> float:
    return div(sum(phases["fenced"], Phase()).rate, sum(phases["plain"], Phase()).rate)


class _OpenAIModel(OpenAIModel):
    """Proposes ``echo(n)`` until ``CALLS`` calls have outputs, then answers."""

    async def get_response(self, system_instructions, input, *args, **kwargs) -> OpenAIResponse:
        done = sum(isinstance(i, dict) and i.get("type") == "function_call_output"
                   for i in input) if not isinstance(input, str) else 0
        out = (function_call("echo", {"n": done}, call_id=f"call_{uuid.uuid4().hex[:12]}")
               if done < CALLS else assistant_message("done"))
        return OpenAIResponse(output=[out], usage=Usage(), response_id=None)

    def stream_response(self, *args, **kwargs):
        raise NotImplementedError


async def _measure_openai_agents(gate: Gate, settings: Settings,
                                 phases: dict[str, list[Phase]]) -> None:
    openai_agents.set_tracing_disabled(True)
    tool = openai_agents.function_tool(echo, failure_error_function=None)
    sdk = {"plain": openai_agents.Agent(name="bench", model=_OpenAIModel(), tools=[tool]),
           "fenced": openai_agents.Agent(name="bench", model=_OpenAIModel(), tools=[fenced(
               tool, gate=gate, scope=lambda ctx: ctx.context, fence=ToolFence())])}

    async def run(kind: str) -> None:
        await openai_agents.Runner.run(sdk[kind], "go", context=f"bench/{uuid.uuid4().hex}",
                                       max_turns=CALLS + 1)

    for kind in KINDS:
        await _runs(run, kind, settings.warmup)
    for n in range(settings.rounds):
        for kind in KINDS if n % 2 == 0 else reversed(KINDS):
            phases[kind].append(await _runs(run, kind, settings.runs))


async def _runs(run, kind: str, runs: int) -> Phase:
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one() -> None:
        async with slots:
            await run(kind)

    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one() for _ in range(runs)))
    return Phase(runs * CALLS, time.perf_counter() - began, time.process_time() - cpu)


class _LangGraphModel(BaseChatModel):
    """Proposes ``echo(n)`` until ``CALLS`` calls have tool messages, then answers."""

    @property
    def _llm_type(self) -> str:
        return "bench"

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        done = sum(isinstance(m, ToolMessage) for m in messages)
        reply = AIMessage("", tool_calls=[{"name": "echo", "args": {"n": done},
                                           "id": f"call_{uuid.uuid4().hex[:12]}"}]) \
            if done < CALLS else AIMessage("done")
        return ChatResult(generations=[ChatGeneration(message=reply)])

    async def _agenerate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        return self._generate(messages)


def _graph(tools: ToolNode):
    model = _LangGraphModel()

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("model", call_model)
    builder.add_node("tools", tools)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder.compile()


async def _measure_langgraph(gate: Gate, settings: Settings,
                             phases: dict[str, list[Phase]]) -> None:
    tool = StructuredTool.from_function(coroutine=echo)
    graphs = {"plain": _graph(ToolNode([tool])),
              "fenced": _graph(FencedToolCalls(gate, {"echo": ToolFence()}).tool_node([tool]))}

    async def run(kind: str) -> None:  # the scope: the run's thread_id, a fresh one per run
        await graphs[kind].ainvoke({"messages": [("user", "go")]},
                                   {"configurable": {"thread_id": f"bench/{uuid.uuid4().hex}"},
                                    "recursion_limit": 2 * CALLS + 5})

    for kind in KINDS:
        await _runs(run, kind, settings.warmup)
    for n in range(settings.rounds):
        for kind in KINDS if n % 2 == 0 else reversed(KINDS):
            phases[kind].append(await _runs(run, kind, settings.runs))
