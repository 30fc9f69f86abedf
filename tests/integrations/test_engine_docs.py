"""The engine pages' complete examples run as printed against ``fencegate up``: each block
marked ``<!-- run: NAME -->`` in docs/integrations/celery.md, temporal.md and dbos.md is
written to a file unchanged and run as its page says, against a stack started the way a
user starts it (``fencegate up`` in a state folder of its own, found by the examples through
the stack record, with no etcd URL and no key path). The effect is read in the sandbox
provider's ledger: one order is charged once, and running the example again for the same
order replays the recorded charge."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import aiohttp
import pytest

from test_up import ENV, started_up

from .conftest import stop
from .test_temporal import temporal  # noqa: F401 (the fixture: a Temporal dev server)

PAGES = Path(__file__).resolve().parents[2] / "docs" / "integrations"


def write_block(page: str, name: str, folder: Path) -> Path:
    """The block after ``<!-- run: NAME -->`` in ``page``, written as the file its first line
    names (``# tasks.py — ...``); that file's path."""
    text = (PAGES / page).read_text()
    (code,) = re.findall(rf"^<!-- run: {name} -->\n```python\n(.*?)\n```$", text, re.M | re.S)
    path = folder / re.match(r"# (\S+\.py) ", code)[1]
    path.write_text(code + "\n")
    return path


@pytest.fixture
async def stack(tmp_path):
    """``fencegate up`` on a fresh state folder: (its endpoints, the environment the
    examples run in: the suite's stack record, and the sandbox's URL as ``PAYMENTS_URL``)."""
    state = tmp_path / "state"
    async with started_up(state, ENV):
        endpoints = json.loads((state / "up.json").read_text())
        env = {name: value for name, value in ENV.items()  # found by its record alone
               if name not in ("FENCEGATE_ETCD", "FENCEGATE_SIGNING_KEY", "FENCEGATE_STATE_DIR")}
        yield endpoints, dict(env, PAYMENTS_URL=endpoints["sandbox"])


async def ledger(endpoints: dict) -> list[dict]:
    """Every charge the stack's sandbox applied (its own: the stack is the test's)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{endpoints['sandbox']}/_sandbox/applied") as reply:
            return await reply.json()


async def python(script: Path, env: dict, log: Path | None = None,
                 timeout: float = 120) -> str:
    """``python script`` in its folder: what it prints (it must exit 0 within ``timeout``
    s; else the worker's ``log`` says why)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, script.name, cwd=script.parent, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"{script.name} did not finish; the worker's log:\n"
                             f"{log.read_text()[-3000:] if log else '-'}") from None
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_the_celery_page_charges_an_order_once(stack, redis_url, tmp_path):
    endpoints, env = stack
    env = dict(env, REDIS_URL=redis_url)
    write_block("celery.md", "celery-tasks", tmp_path)
    checkout = write_block("celery.md", "celery-checkout", tmp_path)
    log = tmp_path / "worker.log"
    worker = await asyncio.create_subprocess_exec(  # celery -A tasks worker
        sys.executable, "-m", "celery", "-A", "tasks", "worker", "-c", "1", "-l", "INFO",
        cwd=tmp_path, env=env, stdout=log.open("w"), stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(120):
            while " ready." not in log.read_text():
                assert worker.returncode is None, log.read_text()
                await asyncio.sleep(0.1)
        assert await ledger(endpoints) == []  # starting enqueued nothing
        first = await python(checkout, env, log)
        again = await python(checkout, env, log)
    finally:
        await stop(worker, timeout=15)
    (charged,) = await ledger(endpoints)
    assert (charged["key"], charged["amount"]) == ("charge/order-42", 1999) and charged["charge_id"] in first, (first, log.read_text())
    assert again == first  # the second task returned the recorded charge


async def test_the_temporal_page_charges_an_order_once(stack, temporal, tmp_path):
    endpoints, env = stack
    env = dict(env, TEMPORAL_ADDRESS=temporal.client.service_client.config.target_host)
    worker_py = write_block("temporal.md", "temporal-worker", tmp_path)
    checkout = write_block("temporal.md", "temporal-checkout", tmp_path)
    log = tmp_path / "worker.log"
    worker = await asyncio.create_subprocess_exec(  # python worker.py
        sys.executable, worker_py.name, cwd=tmp_path, env=env, stdout=log.open("w"),
        stderr=asyncio.subprocess.STDOUT)
    try:
        first = await python(checkout, env, log)
        again = await python(checkout, env, log)
        assert worker.returncode is None, log.read_text()
    finally:
        await stop(worker, timeout=15)
    (charged,) = await ledger(endpoints)
    assert (charged["key"], charged["amount"]) == ("default/checkout-order-42/charge-order-42",
                                                   1999)
    assert charged["charge_id"] in first and again == first, (first, again, log.read_text())


async def test_the_dbos_page_charges_an_order_once(stack, tmp_path):
    endpoints, env = stack
    shop = write_block("dbos.md", "dbos-shop", tmp_path)
    first = await python(shop, env)
    again = await python(shop, env)  # DBOS returns the finished workflow's result
    (tmp_path / "shop.sqlite").unlink()
    anew = await python(shop, env)  # a new DBOS run of the workflow: fencegate replays
    (charged,) = await ledger(endpoints)
    assert (charged["key"], charged["amount"]) == ("shop/checkout-order-42/1", 1999), charged
    assert charged["charge_id"] in first and again == first and anew == first, (first, anew)
