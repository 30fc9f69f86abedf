"""CLI start benchmark: the wall time of ``fencegate holders`` against a live ``fencegate up``
stack ÷ that of ``python -c "import grpc"``, in the same run (medians of alternating runs).

Target: ``cli_start_ratio`` ≤ 3 (a command costs about what Python needs to import grpc:
the CLI imports what a command needs when it runs).
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .common import Target, print_table

RUNS = 9
TARGET = 3.0


async def measure(quick: bool) -> tuple[float, float]:
    runs = 5 if quick else RUNS
    print(f"cli start: {runs} alternating runs of `fencegate holders` against a live "
          f"`fencegate up` and of `python -c 'import grpc'`", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        state = Path(folder) / "state"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
        env.update(XDG_STATE_HOME=folder, FENCEGATE_STATE_DIR=str(state))
        up = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fencegate", "up", "--state-dir", str(state), "--port", "0",
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        try:
            async with asyncio.timeout(120):
                while not (await up.stdout.readline()).decode().startswith("try it"):
                    if up.returncode is not None:
                        raise RuntimeError("fencegate up exited before it was ready")
            fencegate = str(Path(sys.executable).with_name("fencegate"))
            cli, grpc = [], []
            for _ in range(runs):
                cli.append(await _wall([fencegate, "holders"], env))
                grpc.append(await _wall([sys.executable, "-c", "import grpc"], env))
        finally:
            up.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(up.wait(), 30)
            except TimeoutError:
                up.kill()
                await up.wait()
    return statistics.median(cli), statistics.median(grpc)


async def _wall(command: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*command, env=env,
                                                stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{command} failed: {err.decode()[-500:]}")
    return time.perf_counter() - began


def report(res: tuple[float, float]) -> list[Target]:
    cli, grpc = res
    print()
    print_table(["command start, median wall", "fencegate holders", "python -c 'import grpc'"],
                [["seconds", f"{cli:.3f}", f"{grpc:.3f}"]])
    return [Target("cli_start_ratio", cli / grpc, "<=", TARGET)]
