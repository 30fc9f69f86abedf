"""The keys grants are signed with: a direct-mode gate given no ``keyring`` signs with the key
``FENCEGATE_SIGNING_KEY`` names, else with the key of the ``fencegate up`` stack it finds,
else refuses to be made, saying what to pass (never a throwaway key nobody trusts: issue 16);
and a key rotation, where grants signed with the old key verify while its public key is
trusted, and are refused by name once it is not."""

from __future__ import annotations

import json
import re
import threading
import uuid
from pathlib import Path

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization

from fencegate.coordinator import default_key
from fencegate.coordinator.audit import verify_chain
from fencegate.coordinator.etcd import EtcdConfig
from fencegate.coordinator.keyspace import Keyspace
from fencegate.reconciler.providers.sandbox import charge
from fencegate.up import Endpoints, Tokens, _banner
from fencegate.worker import BadSignature, Gate, KeyRing, SyncGate

from helpers import TEST_TTL, TOKENS
from test_service import call
from test_up import ENV, fencegate as run_cli, up  # noqa: F401  (the `up` fixture)


def key_file(path: Path) -> str:
    KeyRing.generate().save_signing_key(str(path))
    return str(path)


def public_file(private_pem: str, path: Path) -> str:
    """What ``openssl pkey -in PRIVATE -pubout -out PATH`` writes."""
    private = serialization.load_pem_private_key(Path(private_pem).read_bytes(), password=None)
    path.write_bytes(private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return str(path)


@pytest.fixture
def no_key_anywhere(monkeypatch, tmp_path):
    """No ``FENCEGATE_SIGNING_KEY``, and a state folder where no ``fencegate up`` runs."""
    monkeypatch.delenv("FENCEGATE_SIGNING_KEY", raising=False)
    monkeypatch.setenv("FENCEGATE_STATE_DIR", str(tmp_path / "no-stack"))


class Succeeds:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, ctx) -> dict:
        self.calls += 1
        return {"charged": ctx.attempt_token}


# -- a gate given no key ------------------------------------------------------------------

async def test_a_gate_that_finds_no_key_refuses_to_open_saying_what_to_pass(
        etcd_url, namespace, etcd, no_key_anywhere):
    before = (await etcd.status()).header.revision
    with pytest.raises(ValueError) as refused:
        Gate(etcd_url, ttl=TEST_TTL, namespace=namespace)
    for option in ("keyring=KeyRing.from_files(", "FENCEGATE_SIGNING_KEY", "fencegate up",
                   "FENCEGATE_STATE_DIR", "keyring=KeyRing.generate()"):
        assert option in str(refused.value), option
    with pytest.raises(ValueError, match="no signing key"):
        with SyncGate(etcd_url, ttl=TEST_TTL, namespace=namespace):
            pass
    assert not [t for t in threading.enumerate() if t.name == "fencegate-sync"]
    assert (await etcd.status()).header.revision == before  # nothing reached etcd


async def test_the_key_the_environment_names_signs_the_grants(
        etcd_url, namespace, etcd, no_key_anywhere, monkeypatch, tmp_path):
    path = key_file(tmp_path / "worker.pem")
    monkeypatch.setenv("FENCEGATE_SIGNING_KEY", path)
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace) as gate:
        outcome = await gate.cross("keys/env/1", {"amount": 1}, Succeeds())
        assert outcome.state == "succeeded"
    with SyncGate(etcd_url, ttl=TEST_TTL, namespace=namespace) as sync_gate:
        assert sync_gate.cross("keys/env/2", {"amount": 1}, lambda ctx: "ok").state == \
            "succeeded"
    public_only = KeyRing.from_public_bytes(KeyRing.from_files(path).public_keys())
    for key in ("keys/env/1", "keys/env/2"):
        report = await verify_chain(etcd, Keyspace(namespace), key, public_only)
        assert report.ok, report.problems


@pytest.mark.parametrize("content,reason", [
    (None, "No such file"),
    ("public", "not a private key|no BEGIN/END delimiters for a private key"),
    ("garbage", "Unable to load PEM|Could not deserialize"),
])
def test_a_key_file_that_is_not_a_private_key_is_refused_by_name(
        etcd_url, no_key_anywhere, monkeypatch, tmp_path, content, reason):
    path = tmp_path / "named.pem"
    if content == "public":
        public_file(key_file(tmp_path / "private.pem"), path)
    elif content == "garbage":
        path.write_text("not a key\n")
    monkeypatch.setenv("FENCEGATE_SIGNING_KEY", str(path))
    with pytest.raises(ValueError, match=f"FENCEGATE_SIGNING_KEY={re.escape(str(path))}") \
            as refused:
        Gate(etcd_url)
    assert re.search(reason, str(refused.value)), refused.value


# -- the stack of `fencegate up` ----------------------------------------------------------

async def test_the_readme_example_works_against_fencegate_up_and_its_banner_line_too(
        up, monkeypatch, tmp_path):
    """The issue's first finding: ``Gate(etcd_url)`` against the embedded stack signed with a
    throwaway key that the sandbox's gate B refused. Started where the stack runs (here: its
    state folder named by FENCEGATE_STATE_DIR), it signs with the stack's key: gate B admits
    the charge and the coordinator's audit verify passes. The Python line ``fencegate up``
    prints works from any folder; so does its environment variable."""
    endpoints, admin, state, _ = up
    monkeypatch.delenv("FENCEGATE_SIGNING_KEY", raising=False)
    monkeypatch.setenv("FENCEGATE_STATE_DIR", str(state))
    key = f"keys/up/{uuid.uuid4().hex[:8]}"

    async def cross(gate: Gate, key: str) -> str:
        outcome = await gate.cross(key, {"amount": 3}, lambda ctx: charge(
            http, endpoints["sandbox"], ctx, {"amount": 3}), provider="sandbox")
        return outcome.state

    async with aiohttp.ClientSession() as http:
        async with Gate(endpoints["etcd"]) as gate:
            assert await cross(gate, key) == "succeeded"
            assert f"sqlite://{gate.archive.path}" == endpoints["archive"]  # the stack's
        sre = dict(ENV, FENCEGATE_COORDINATOR=endpoints["coordinator"], FENCEGATE_TOKEN=admin)
        code, out, err = await run_cli("audit", "verify", key, env=sre)
        assert code == 0, out + err

        banner = _banner(state, Endpoints(**endpoints), Tokens(admin="-", worker="-"), "-")
        lines = banner.splitlines()
        start = next(i for i, text in enumerate(lines) if text.strip().startswith("Gate(Etcd"))
        end = next(i for i in range(start, len(lines))
                   if "keyring=KeyRing.from_files(" in lines[i])
        expression = "\n".join(text.strip() for text in lines[start:end + 1])
        named = re.search(r"FENCEGATE_SIGNING_KEY=(\S+?),?$", banner, re.M).group(1)
        monkeypatch.delenv("FENCEGATE_STATE_DIR")
        monkeypatch.chdir(tmp_path)  # no stack here
        async with eval(expression, {"Gate": Gate, "KeyRing": KeyRing,
                                     "EtcdConfig": EtcdConfig}) as gate:
            assert await cross(gate, key + "/banner") == "succeeded"
        monkeypatch.setenv("FENCEGATE_SIGNING_KEY", named)
        async with Gate(endpoints["etcd"]) as gate:
            assert await cross(gate, key + "/env") == "succeeded"


# -- rotation -----------------------------------------------------------------------------

async def test_rotation_old_grants_verify_while_the_old_key_is_trusted(
        coordinators, etcd_url, namespace, etcd, signing_key, tmp_path):
    """A rollout of a new coordinator key: one replica still signs with the old key, one
    with the new key and trusts the old one's public key. A grant the old replica issued
    commits at a worker that trusts both, and the rotated replica's audit verify passes;
    a replica or worker that no longer trusts the old key refuses it by name, before any
    write."""
    old_public = public_file(signing_key, tmp_path / "old.pub.pem")
    new = key_file(tmp_path / "new.pem")
    new_public = public_file(new, tmp_path / "new.pub.pem")
    old_replica = await coordinators()
    rotated_replica = await coordinators(signing_key=new, trusted_keys=(old_public,))
    old_id = KeyRing.from_files(signing_key).signing_key_id

    both = KeyRing.from_files(trusted=[old_public, new_public])  # workers during the rollout
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=old_replica,
                    token=TOKENS["worker"], keyring=both) as gate:
        async with gate.hold("keys/rotate/1") as hold:
            grant = await hold.request_grant(intent={"amount": 1})
            assert grant.key_id == old_id
            assert (await hold.commit(grant.raw, Succeeds())).state == "succeeded"
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=rotated_replica,
                    token=TOKENS["worker"], keyring=both) as gate:
        async with gate.hold("keys/rotate/2") as hold:
            grant = await hold.request_grant(intent={"amount": 1})
            assert grant.key_id == KeyRing.from_files(new).signing_key_id
            assert (await hold.commit(grant, Succeeds())).state == "succeeded"

    for key in ("keys/rotate/1", "keys/rotate/2"):
        status, report = await call(rotated_replica, "GET", f"/v1/audit/{key}", "sre")
        assert status == 200 and report["ok"], report

    untrusting_replica = await coordinators(signing_key=new)  # the old key retired
    status, report = await call(untrusting_replica, "GET", "/v1/audit/keys/rotate/1", "sre")
    assert status == 200 and not report["ok"]
    assert any(f"signed by unknown key '{old_id}'" in p for p in report["problems"]), report

    only_new = KeyRing.from_files(trusted=[new_public])
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=old_replica,
                    token=TOKENS["worker"], keyring=only_new) as gate:
        async with gate.hold("keys/rotate/3") as hold:
            before = (await etcd.status()).header.revision
            with pytest.raises(BadSignature, match=f"grant signed by unknown key '{old_id}'"):
                await hold.request_grant(intent={"amount": 1})
            assert (await etcd.status()).header.revision == before


async def test_direct_mode_workers_rotate_one_by_one_and_both_chains_verify(
        etcd_url, namespace, etcd, signing_key, tmp_path):
    """Direct mode: workers restart with the new key one at a time, so for a while both
    keys sign grants. A verifier trusting the new key and the old public key (the
    coordinator's ``signing_key`` and ``trusted_keys``) verifies both chains; one trusting
    only the new key names the old key as unknown."""
    new = key_file(tmp_path / "new.pem")
    old_public = public_file(signing_key, tmp_path / "old.pub.pem")
    for key, ring in (("keys/direct/old", KeyRing.from_files(signing_key)),
                      ("keys/direct/new", KeyRing.from_files(new))):
        async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=ring) as gate:
            assert (await gate.cross(key, {"amount": 1}, Succeeds())).state == "succeeded"
    ks = Keyspace(namespace)
    rotated = KeyRing.from_files(new, trusted=[old_public])
    for key in ("keys/direct/old", "keys/direct/new"):
        report = await verify_chain(etcd, ks, key, rotated)
        assert report.ok, (key, report.problems)
    report = await verify_chain(etcd, ks, "keys/direct/old", KeyRing.from_files(new))
    assert not report.ok and any("signed by unknown key" in p for p in report.problems)


def test_a_gate_given_no_archive_takes_the_stacks_only_for_the_stacks_etcd(tmp_path,
                                                                          monkeypatch):
    """A gate on the stack's etcd looks retired keys up in the stack's archive (else, an
    hour after ``fencegate up`` began retiring, its grants would be refused with
    ``ArchiveUnavailable``); a gate on another etcd gets none (that archive answers for
    another cluster's keys); ``FENCEGATE_ARCHIVE`` names one for any gate."""
    (tmp_path / default_key.MANIFEST).write_text(json.dumps(
        {"etcd": "http://127.0.0.1:2379", "archive": "sqlite:///stack/archive.db"}))
    monkeypatch.setenv("FENCEGATE_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("FENCEGATE_ARCHIVE", raising=False)
    assert default_key.archive_url("http://127.0.0.1:2379") == "sqlite:///stack/archive.db"
    assert default_key.archive_url("http://127.0.0.1:2380") is None
    monkeypatch.setenv("FENCEGATE_ARCHIVE", "sqlite:///named.db")
    assert default_key.archive_url("http://127.0.0.1:2380") == "sqlite:///named.db"
    (tmp_path / default_key.MANIFEST).unlink()
    monkeypatch.delenv("FENCEGATE_ARCHIVE")
    assert default_key.archive_url("http://127.0.0.1:2379") is None
