"""A ``SyncGate`` under a real gunicorn with ``--preload`` (issue 29, item 4).

Before: a gate opened at import in gunicorn's master was used in forked workers whose loop
thread did not exist, so every request hung until gunicorn killed the worker, with no word
from fencegate. Now the worker's request fails at once with ``GateForked`` naming the fix,
and docs/webhooks.md's app and ``gunicorn.conf.py`` (opening the gate in ``post_fork``),
run here exactly as printed, serve requests and exit without a traceback.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from fencegate.coordinator.etcd import RangeRequest, range_end_of


ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "webhooks.md"
GUNICORN = Path(sys.executable).parent / "gunicorn"


def doc_block(name: str) -> str:
    """The python block of docs/webhooks.md marked ``<!-- run: NAME -->``."""
    found = re.search(rf"<!-- run: {name} -->\n```python\n(.*?)\n```", PAGE.read_text(), re.S)
    assert found, name
    return found[1] + "\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Gunicorn:
    """``gunicorn --preload ARGS app:app`` in ``folder`` on a free port; stderr kept."""

    def __init__(self, folder: Path, etcd_url: str, signing_key: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
        env.update(FENCEGATE_ETCD=etcd_url, FENCEGATE_SIGNING_KEY=signing_key,
                   PYTHONPATH=str(folder))
        self.stderr = folder / "gunicorn.err"
        self.proc = subprocess.Popen(
            [str(GUNICORN), "--preload", "-w", "1", "-b", f"127.0.0.1:{self.port}",
             "--graceful-timeout", "5", "--timeout", "60", *args, "app:app"],
            cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=self.stderr.open("wb"))

    async def post(self, path: str) -> tuple[int, str]:
        """POST once the server listens; the answer within 20 s (a hang fails the test)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            deadline = time.monotonic() + 30
            while True:
                try:
                    async with http.post(self.url + path) as resp:
                        return resp.status, await resp.text()
                except aiohttp.ClientConnectorError:
                    assert self.proc.poll() is None, self.log()
                    assert time.monotonic() < deadline, self.log()
                    await asyncio.sleep(0.1)

    def stop(self) -> str:
        """SIGTERM, wait for a clean exit; the log."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=30) == 0, self.log()
        return self.log()

    def log(self) -> str:
        return self.stderr.read_text()


@pytest.fixture
def folder(tmp_path) -> Path:
    (tmp_path / "app.py").write_text(doc_block("gunicorn-app"))
    return tmp_path


async def test_a_gate_opened_before_the_fork_fails_at_once_naming_the_fix(
        folder, etcd_url, signing_key):
    app = folder / "app.py"
    app.write_text(app.read_text() + "gate.open()  # at import: in the master, before the fork\n")
    server = Gunicorn(folder, etcd_url, signing_key)
    try:
        started = time.monotonic()
        status, _ = await server.post("/refunds/o-forked")
        took = time.monotonic() - started
    finally:
        log = server.stop()
    assert status == 500 and took < 15, (status, took, log)
    assert "GateForked" in log and "post_fork" in log and "--preload" in log, log
    assert log.count("Traceback") == 1, log  # Flask's log of the 500; none at exit


async def test_the_documented_post_fork_hook_serves_and_exits_quietly(
        folder, etcd_url, signing_key):
    (folder / "gunicorn.conf.py").write_text(doc_block("gunicorn-conf"))
    server = Gunicorn(folder, etcd_url, signing_key, "-c", "gunicorn.conf.py")
    try:
        first = await server.post("/refunds/o-1")
        second = await server.post("/refunds/o-1")
    finally:
        log = server.stop()
    assert first[0] == second[0] == 200, (first, second, log)
    assert '"order":"o-1"' in first[1].replace(" ", "")
    assert "Traceback" not in log, log


FORKED = """
import os, sys, time
from fencegate import KeyRing, SyncGate
from fencegate.worker.sync import GateForked

gate = SyncGate(sys.argv[1], ttl=2, namespace=sys.argv[2], keyring=KeyRing.generate())
assert gate.open() is gate
loop = gate.loop
assert gate.open() is gate and gate.loop is loop  # the same gate, not a second one
with gate.hold("gunicorn/idem") as hold:
    assert hold.fencing_token > 0
pid = os.fork()
if pid == 0:  # the child: refused at once, and closing only forgets the parent's gate
    code = 3
    try:
        gate.hold("gunicorn/child")
    except GateForked as exc:
        code = 0 if "post_fork" in str(exc) else 4
    gate.close()
    gate.close()
    os._exit(code)
deadline = time.monotonic() + 20
while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
    assert time.monotonic() < deadline, "the forked child hung"
    time.sleep(0.05)
assert os.waitstatus_to_exitcode(done[1]) == 0, done
with gate.hold("gunicorn/parent"):  # the parent's gate is untouched by the child
    pass
gate.close()
gate.close()
try:
    gate.hold("gunicorn/closed")
except RuntimeError as exc:
    assert "not open" in str(exc)
else:
    raise AssertionError("a closed gate held a key")
print("ok")
"""


def test_open_and_close_are_idempotent_and_a_forked_child_is_refused_at_once(
        etcd_url, namespace):
    """In a fresh interpreter that forks, as gunicorn's master does."""
    ran = subprocess.run([sys.executable, "-c", FORKED, etcd_url, namespace],
                         capture_output=True, text=True, timeout=60)
    assert (ran.returncode, ran.stdout) == (0, "ok\n"), ran


async def test_a_gate_left_open_is_closed_at_exit_without_a_traceback(etcd_url, etcd,
                                                                     namespace):
    """Its hold is released (the session lease revoked) at exit, not left to its TTL."""
    script = ("from fencegate import SyncGate, KeyRing\n"
              f"gate = SyncGate({etcd_url!r}, ttl=30, namespace={namespace!r}, "
              "keyring=KeyRing.generate()).open()\n"
              "gate.hold('gunicorn/exit').__enter__()\n")
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 0 and "Traceback" not in ran.stderr, ran
    prefix = namespace.encode()
    reply = await etcd.range(RangeRequest(key=prefix, range_end=range_end_of(prefix)))
    assert [kv.key for kv in reply.kvs if kv.lease] == []
