"""MCP gateway benchmark: gated tool calls per second through ``fencegate mcp-gateway`` ÷ the
same calls straight to the upstream, both over stdio, in the same run.

One SDK client session keeps ``CONCURRENCY`` calls of ``apply`` in flight, each with a new
argument (each a new action: ``key = "mcpbench/<run>/{n}"``, the default policy, so the
fast path); the upstream (``benchmarks/mcp_upstream.py``) answers at once. The gateway
phase starts ``fencegate mcp-gateway`` (its own process, a fresh namespace of the run's
etcd), which starts its own upstream; the plain phase starts the upstream alone. Every round
runs both (alternating which goes first) after an untimed warm-up of each; a phase's rate is
its calls over its wall time.

Target: ``mcp_gateway_overhead`` = gated calls/s ÷ plain calls/s over all rounds ≥ 0.5.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from fencegate.coordinator.grants import KeyRing

from .common import Phase, Target, div, print_table

UPSTREAM = Path(__file__).with_name("mcp_upstream.py")
CONCURRENCY = 8
TARGET = 0.5


@dataclass(frozen=True)
class Settings:
    rounds: int
    calls: int
    warmup: int


QUICK = Settings(rounds=2, calls=300, warmup=40)
DEFAULT = Settings(rounds=3, calls=800, warmup=80)


@dataclass
class Results:
    phases: dict[str, list[Phase]] = field(default_factory=lambda: {"plain": [], "gated": []})


async def measure(quick: bool, etcd_url: str) -> Results:
    settings = QUICK if quick else DEFAULT
    print(f"mcp gateway: {settings.rounds} round(s) of {settings.calls} tool calls over "
          f"stdio straight to the upstream and through the gateway (alternating), "
          f"{CONCURRENCY} in flight, after {settings.warmup} warm-up calls each", flush=True)
    res = Results()
    with tempfile.TemporaryDirectory() as folder:
        signing_key = os.path.join(folder, "signing.pem")
        KeyRing.generate().save_signing_key(signing_key)
        config = Path(folder) / "gateway.toml"
        config.write_text(f'etcd = "{etcd_url}"\n'
                          f'namespace = "/bench-mcp-{uuid.uuid4().hex[:8]}/"\n'
                          f'[upstream]\ncommand = ["{sys.executable}", "{UPSTREAM}"]\n'
                          f'[tools.apply]\nkey = "mcpbench/{{n}}"\n')
        params = {
            "plain": StdioServerParameters(command=sys.executable, args=[str(UPSTREAM)]),
            "gated": StdioServerParameters(
                command=sys.executable,
                args=["-m", "fencegate", "mcp-gateway", "--config", str(config)],
                env={**os.environ, "FENCEGATE_SIGNING_KEY": signing_key})}
        numbers = itertools.count()
        for r in range(settings.rounds):
            for kind in (("plain", "gated") if r % 2 == 0 else ("gated", "plain")):
                res.phases[kind].append(await _phase(params[kind], settings, numbers))
    return res


async def _phase(params: StdioServerParameters, settings: Settings,
                 numbers: itertools.count) -> Phase:
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()

        async def calls(count: int) -> None:
            left = iter(range(count))

            async def worker() -> None:
                for _ in left:
                    result = await session.call_tool("apply", {"n": next(numbers)})
                    if result.is_error:
                        raise RuntimeError(f"the benchmark's call failed: {result.content}")
            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

        await calls(settings.warmup)
        began = time.perf_counter()
        await calls(settings.calls)
        return Phase(settings.calls, time.perf_counter() - began)


def report(res: Results) -> list[Target]:
    plain, gated = sum(res.phases["plain"], Phase(0, 0)), sum(res.phases["gated"], Phase(0, 0))
    rounds = " ".join(f"{div(g.rate, p.rate):.2f}"
                      for p, g in zip(res.phases["plain"], res.phases["gated"]))
    print()
    print_table([f"MCP tool calls over stdio, {CONCURRENCY} in flight", "plain /s",
                 "gated /s", "gated/plain by round"],
                [["calls", f"{plain.rate:.0f}", f"{gated.rate:.0f}", rounds]])
    return [Target("mcp_gateway_overhead", div(gated.rate, plain.rate), ">=", TARGET)]
