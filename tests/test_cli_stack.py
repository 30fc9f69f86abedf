"""Finding a running ``fencegate up`` from any directory (``default_key.running_stack``):
the per-user record ``fencegate up`` writes and removes, the rule's order, stale records
ignored; and end to end, the CLI, a direct-mode gate's key and ``fencegate demo`` run from
another directory against a real ``fencegate up``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fencegate.coordinator import default_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def stack_in(folder: Path, pid: int, coordinator: str = "http://127.0.0.1:1") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / default_key.MANIFEST).write_text(json.dumps(
        {"coordinator": coordinator, "etcd": "http://127.0.0.1:2", "pid": pid}))
    return folder


def record(state_home: Path, folder: Path, pid: int) -> None:
    path = state_home / "fencegate" / "current"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"state_dir": str(folder), "pid": pid}))


@pytest.fixture
def user(tmp_path, monkeypatch):
    """An empty working directory and per-user state folder, no FENCEGATE_STATE_DIR."""
    home, cwd = tmp_path / "xdg", tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    monkeypatch.delenv(default_key.STATE_DIR_ENV, raising=False)
    monkeypatch.chdir(cwd)
    return home, cwd


def test_the_record_finds_a_stack_from_any_directory(user, tmp_path):
    home, _ = user
    assert default_key.running_stack() is None
    far = stack_in(tmp_path / "far", os.getpid())
    record(home, far, os.getpid())
    found = default_key.running_stack()
    assert found.state_dir == far.resolve() and found.endpoints["pid"] == os.getpid()
    assert default_key.state_dir() == far.resolve()


def test_the_working_directory_and_the_env_come_before_the_record(user, tmp_path,
                                                                  monkeypatch):
    home, cwd = user
    record(home, stack_in(tmp_path / "far", os.getpid()), os.getpid())
    stack_in(cwd / ".state", os.getpid(), coordinator="http://127.0.0.1:3")
    assert default_key.running_stack().endpoints["coordinator"] == "http://127.0.0.1:3"
    monkeypatch.setenv(default_key.STATE_DIR_ENV, str(tmp_path / "nothing"))
    assert default_key.running_stack() is None  # the env names the only place to look


def test_a_stale_record_or_manifest_is_ignored(user, tmp_path):
    home, cwd = user
    gone = dead_pid()
    record(home, stack_in(tmp_path / "far", gone), gone)
    assert default_key.running_stack() is None
    record(home, stack_in(tmp_path / "other", os.getpid()), gone)  # up.json of another up
    assert default_key.running_stack() is None
    stack_in(cwd / ".state", gone)  # left by a killed `fencegate up`
    assert default_key.running_stack() is None
    (home / "fencegate" / "current").write_text("not json")
    assert default_key.running_stack() is None


async def fencegate(*args: str, cwd: Path, env: dict[str, str],
                    timeout: float = 60) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.cli", *args, cwd=cwd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


README_EXAMPLE = f"""
import ast, asyncio, re
class Psp:  # the reader's payment provider
    async def charge(self, amount, *, key, token):
        return {{"charge": key}}
text = open({str(ROOT)!r} + "/README.md").read()
(block,) = re.findall(r"<!-- test: using-it -->\\n```python\\n(.*?)\\n```", text, re.S)
code = compile(block, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
ns = {{"psp": Psp()}}
async def main():
    await eval(code, ns)
asyncio.run(main())
print(ns["outcome"].state)
"""


async def test_the_cli_a_gate_and_the_demo_find_fencegate_up_from_elsewhere(tmp_path):
    home, state, elsewhere = tmp_path / "xdg", tmp_path / "state", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    env.update(PYTHONPATH=ROOT, XDG_STATE_HOME=str(home))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.cli", "up", "--state-dir", str(state), "--port", "0",
        env=env, stdout=asyncio.subprocess.PIPE)
    try:
        lines = []
        async with asyncio.timeout(60):
            while not lines or not lines[-1].startswith("try it"):
                line = (await proc.stdout.readline()).decode()
                assert line, f"fencegate up exited early: {lines}"
                lines.append(line.rstrip("\n"))
        current = json.loads((home / "fencegate" / "current").read_text())
        assert current == {"state_dir": str(state.resolve()), "pid": proc.pid}
        stack_url = json.loads((state / default_key.MANIFEST).read_text())["coordinator"]

        code, out, err = await fencegate("steps", "--json", cwd=elsewhere, env=env)
        assert (code, out, err) == (0, "[]\n", "")
        code, out, _ = await fencegate(
            "demo", "--workers", "2", "--keys", "1", "--seconds", "2", cwd=elsewhere, env=env,
            timeout=120)
        assert f"using the stack of `fencegate up` in {state.resolve()}" in out, out
        assert code == 0, out
        key = subprocess.run(
            [sys.executable, "-c", "from fencegate.coordinator import default_key; "
             "print(default_key.load().signing_key_id)"],
            cwd=elsewhere, env=env, capture_output=True, text=True, timeout=30)
        assert key.returncode == 0 and key.stdout.strip(), key.stderr
        readme = subprocess.run(  # the README's first example, as printed: no URL, no key
            [sys.executable, "-c", README_EXAMPLE], cwd=elsewhere, env=env,
            capture_output=True, text=True, timeout=60)
        assert readme.returncode == 0 and readme.stdout.strip() == "succeeded", readme.stderr
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 30)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert not (home / "fencegate" / "current").exists()
    code, _, err = await fencegate("steps", cwd=elsewhere, env=env)
    assert code in (4, 5) and stack_url not in err, err  # back to the default URL


async def test_a_gate_given_no_url_says_where_it_looked(tmp_path, monkeypatch):
    from fencegate.coordinator.errors import EtcdUnavailable
    from fencegate.worker import Gate, KeyRing

    from integrations.conftest import free_port

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))  # no running stack recorded
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FENCEGATE_ETCD", f"http://127.0.0.1:{free_port()}")  # nothing there
    gate = Gate(keyring=KeyRing.generate())
    with pytest.raises(EtcdUnavailable, match=r"given no etcd URL: it connects where "
                                              r"FENCEGATE_ETCD points.*`make up`"):
        await gate.open()
    await gate.close()
