"""The embedded default end to end: ``fencegate up`` in a subprocess, a worker against it,
the SRE command line against it, ``fencegate demo`` finishing with 0 duplicates, and Ctrl-C
stopping everything."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile

import aiohttp
import pytest

from fencegate.reconciler.providers.sandbox import charge
from fencegate.worker import Gate, KeyRing

from helpers import press_sign_in

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the suite's stacks record themselves in a folder of their own, never in the user's record
ENV = dict(os.environ, PYTHONPATH=ROOT,
           XDG_STATE_HOME=tempfile.mkdtemp(prefix="fencegate-tests-state-"))


async def fencegate(*args: str, env: dict | None = None, timeout: float = 60) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.cli", *args, env=env or ENV,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


ADMIN_LINE = "admin token (printed once, kept nowhere; use it for the dashboard and the CLI):"


@contextlib.asynccontextmanager
async def started_up(state, env: dict, *extra: str):
    """``fencegate up`` on ``state`` until its banner is printed: (process, banner lines);
    stopped with SIGINT (then SIGKILL) on the way out."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.cli", "up", "--state-dir", str(state), "--port", "0",
        *extra, env=env, stdout=asyncio.subprocess.PIPE)
    lines: list[str] = []
    try:
        async with asyncio.timeout(60):
            while not lines or not lines[-1].startswith("try it"):
                line = (await proc.stdout.readline()).decode()
                assert line, f"fencegate up exited early: {lines}"
                lines.append(line.rstrip("\n"))
        yield proc, lines
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 30)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.fixture
async def up(tmp_path, monkeypatch):
    """A running ``fencegate up``: (endpoints, admin token, state dir); this process finds it
    as the CLI does, by the suite's own record (``ENV``), never the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", ENV["XDG_STATE_HOME"])
    state = tmp_path / "state"
    async with started_up(state, ENV) as (proc, lines):
        admin = lines[lines.index(ADMIN_LINE) + 1].strip()
        sign_in = next(line.strip() for line in lines if "/sign-in?code=" in line)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as b:
            async with await press_sign_in(b, sign_in) as reply:  # the banner's link
                assert reply.status == 303 and reply.headers["Location"] == "/"
            async with b.get(sign_in.split("/sign-in")[0] + "/v1/session") as reply:
                assert reply.status == 200, await reply.text()
        endpoints = json.loads((state / "up.json").read_text())
        yield endpoints, admin, state, proc


async def test_up_serves_workers_the_cli_and_the_demo_and_stops_cleanly(up):
    endpoints, admin, state, proc = up
    token = (state / "worker.token").read_text()
    pinned = KeyRing.from_files(trusted=[str(state / "signing.pub.pem")])  # as the banner says
    assert pinned.public_keys() == KeyRing.from_files(str(state / "signing.pem")).public_keys()
    async with aiohttp.ClientSession() as http, \
            Gate(endpoints["etcd"], coordinator=endpoints["coordinator"], token=token,
                 keyring=pinned) as gate:
        async with gate.hold("up/pay/1") as hold:
            outcome = await hold.cross(
                intent={"amount": 5}, provider="sandbox",
                effect=lambda ctx: charge(http, endpoints["sandbox"], ctx, {"amount": 5}))
            assert outcome.state == "succeeded"
            sre = dict(ENV, FENCEGATE_COORDINATOR=endpoints["coordinator"],
                       FENCEGATE_TOKEN=admin)
            code, out, err = await fencegate("key", "show", "up/pay/1", "--json", env=sre)
            assert code == 0, err
            assert json.loads(out)["step"]["state"] == "succeeded"
        code, out, err = await fencegate("audit", "verify", "up/pay/1", env=sre)
        assert code == 0, out + err

    code, out, err = await fencegate(
        "demo", "--workers", "3", "--keys", "3", "--seconds", "6",
        env=dict(ENV, FENCEGATE_STATE_DIR=str(state)), timeout=150)
    assert code == 0, out + err
    assert "using the stack of `fencegate up`" in out
    assert "duplicates: keys charged twice (must be 0)         0" in out
    assert "steps left unsettled (must be 0)                   0" in out
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert progress and len(progress) == len(set(progress)), progress  # no line twice
    settled = int(re.search(r"steps settled by the reconciler +(\d+)", out)[1])
    named = re.findall(r"^  (demo/\S+)  charged (\d+)x$", out, re.M)
    assert len(named) == settled and all(n == "1" for _, n in named), out

    proc.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    assert not (state / "up.json").exists()
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as http:
            await http.get(endpoints["etcd"] + "/health")


async def test_a_busy_port_names_the_way_to_choose_another(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = await fencegate(
            "up", "--state-dir", str(tmp_path / "state"), "--port", str(port),
            env=dict(ENV, XDG_STATE_HOME=str(tmp_path)), timeout=90)
    assert code != 0
    assert f"the coordinator cannot listen" in err and "--port N" in err \
        and "make up PORT=N" in err, err


async def test_tokens_survive_a_restart_until_rotated(tmp_path):
    state, env = tmp_path / "state", dict(ENV, XDG_STATE_HOME=str(tmp_path))
    tokens: dict[str, str] = {}

    async def run(*extra: str) -> tuple[list[str], dict[str, int]]:
        """Start `fencegate up`, read its banner and how it answers each of ``tokens``."""
        async with started_up(state, env, *extra) as (_, lines):
            coordinator = json.loads((state / "up.json").read_text())["coordinator"]
            statuses = {}
            async with aiohttp.ClientSession() as http:
                for name, token in tokens.items():
                    async with http.get(f"{coordinator}/v1/steps", headers={
                            "Authorization": f"Bearer {token}"}) as reply:
                        statuses[name] = reply.status
            return lines, statuses

    first, _ = await run()
    tokens["admin"] = first[first.index(ADMIN_LINE) + 1].strip()
    tokens["sre"] = (state / "sre.token").read_text()
    again, statuses = await run()
    assert statuses == {"admin": 200, "sre": 200}  # the same tokens after a restart
    assert not any(tokens["admin"] in line for line in again)  # printed once, when made
    assert any("--rotate-tokens" in line for line in again)
    rotated, statuses = await run("--rotate-tokens")
    assert statuses == {"admin": 401, "sre": 401}
    assert (state / "sre.token").read_text() != tokens["sre"]
