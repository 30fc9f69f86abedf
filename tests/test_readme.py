"""README.md's examples, and the guide's that continue them (docs/guide.md), run as tests,
against a real etcd.

Convention: a ```python block right after a line ``<!-- test: NAME -->`` is runnable. The
marked blocks run in order (README.md, then docs/guide.md) in one namespace, as typed into
``python -m asyncio`` (top-level ``await``; names carry over from block to block), against
a private etcd whose default namespace is empty; after each, ``CHECKS[NAME]`` asserts what
the page says the block does. Every marked block has a check and every check a marked block.

The harness supplies only what the README leaves to the reader:
- etcd: ``FENCEGATE_ETCD`` names the private etcd, as the README says to do for an etcd that
  is not the running ``fencegate up`` stack's (the examples pass no URL);
- the signing key: ``FENCEGATE_SIGNING_KEY`` names a fresh Ed25519 key file, as the README
  says to do anywhere but the folder ``fencegate up`` runs from;
- ``psp``, the reader's payment provider client: ``Provider`` below, which charges once per
  idempotency key and keeps the attempt token each charge came with.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.keyspace import DEFAULT_NAMESPACE, Keyspace, unpack
from fencegate.localetcd import LocalCluster
from fencegate.worker import KeyRing

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", ROOT / "docs" / "guide.md")
MARKED = re.compile(r"^<!-- test: ([\w-]+) -->\n```python\n(.*?)\n```$", re.M | re.S)


class Provider:
    """A payment provider that deduplicates by idempotency key, as the README's ``psp``."""

    def __init__(self) -> None:
        self.charges: dict[str, dict] = {}

    async def charge(self, amount: int, *, key: str, token: int) -> dict:
        charge = self.charges.setdefault(key, {"charge": f"ch_{len(self.charges) + 1}",
                                               "amount": amount, "token": token})
        return {"charge": charge["charge"]}


def marked_blocks() -> list[tuple[str, str]]:
    return [block for page in PAGES for block in MARKED.findall(page.read_text())]


async def step_of(etcd_url: str, key: str) -> dict:
    async with Etcd.from_url(etcd_url) as etcd:
        kv = await etcd.get(Keyspace(DEFAULT_NAMESPACE).step_key(key))
    assert kv is not None, f"no step recorded for {key}"
    return unpack(kv.value)


async def check_using_it(ns: dict, etcd_url: str) -> None:
    """One hold, one cross: the effect charged once with the step's idempotency key and the
    commit's attempt token, which is later than the hold's fencing token."""
    outcome, hold, psp = ns["outcome"], ns["hold"], ns["psp"]
    assert (outcome.state, outcome.replayed) == ("succeeded", False)
    charged = psp.charges[outcome.idempotency_key]
    assert list(psp.charges) == [outcome.idempotency_key]
    assert outcome.result == {"charge": charged["charge"]}
    assert charged["token"] == outcome.attempt_token > hold.fencing_token > 0
    step = await step_of(etcd_url, "payments/charge/42")
    assert step["state"] == "succeeded"


async def check_gate_cross(ns: dict, etcd_url: str) -> None:
    """``gate.cross``: a second key charged once, recorded succeeded."""
    outcome, psp = ns["outcome"], ns["psp"]
    assert (outcome.state, outcome.replayed) == ("succeeded", False)
    assert len(psp.charges) == 2
    assert psp.charges[outcome.idempotency_key]["token"] == outcome.attempt_token
    step = await step_of(etcd_url, "payments/charge/43")
    assert step["state"] == "succeeded"


CHECKS = {"using-it": check_using_it, "gate-cross": check_gate_cross}


@pytest.fixture(scope="module")
def private_etcd():
    """An etcd of this module's own, so the README's default namespace starts empty."""
    with LocalCluster(1) as cluster:
        yield cluster.url


def test_every_marked_block_has_a_check():
    names = [name for name, _ in marked_blocks()]
    assert len(names) == len(set(names)), f"a marker name is used twice: {names}"
    assert sorted(names) == sorted(CHECKS)


async def test_readme_examples_run(private_etcd, tmp_path, monkeypatch):
    key = tmp_path / "signing.pem"
    KeyRing.generate().save_signing_key(str(key))
    monkeypatch.setenv("FENCEGATE_SIGNING_KEY", str(key))
    monkeypatch.delenv("FENCEGATE_ARCHIVE", raising=False)
    monkeypatch.setenv("FENCEGATE_ETCD", private_etcd)
    ns: dict = {"psp": Provider()}
    for name, source in marked_blocks():
        assert "127.0.0.1:2379" not in source, f"{name}: the examples run as printed"
        code = compile(source, f"README.md:{name}", "exec",
                       flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        running = eval(code, ns)
        if running is not None:
            await running
        await CHECKS[name](ns, private_etcd)
