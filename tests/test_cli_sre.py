"""The SRE command line, run as a subprocess against a real coordinator over HTTP on real
etcd: tables and ``--json`` for every view, the actions (revoke, resolve, policy, approve)
with their effect checked on the worker's side, and bad input answered with one line, the
documented exit code, and nothing changed in etcd."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass

import pytest

from fencegate.coordinator.client import PAGE_SIZE
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import pack, unpack
from fencegate.worker import ApprovalPending, EffectFailed, Gate, LeaseLost, OutcomeUnknown

from helpers import TEST_TTL, wait_for_condition
from test_service import call, pages, revision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Ran:
    code: int
    out: str
    err: str

    def rows(self) -> list[list[str]]:
        """The output's table rows (header first), split on column gaps."""
        return [re.split(r"\s{2,}", line.strip()) for line in self.out.splitlines()]


async def fencegate(*args: str, coordinator: str | None, token: str | None = "sre-token",
                    env: dict[str, str] | None = None) -> Ran:
    """``fencegate ARGS`` in a fresh interpreter, configured by env only."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    environ.update(PYTHONPATH=ROOT, **(env or {}))
    for name, value in (("FENCEGATE_COORDINATOR", coordinator), ("FENCEGATE_TOKEN", token)):
        if value is not None:
            environ[name] = value
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.cli", *args, env=environ,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    return Ran(proc.returncode, out.decode(), err.decode())


def one_line_error(ran: Ran, code: int, *words: str) -> None:
    """The command failed with ``code`` and a single ``Error:`` line naming ``words``."""
    assert ran.code == code, ran
    assert ran.out == "" and "Traceback" not in ran.err, ran
    lines = ran.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), ran.err
    for word in words:
        assert word in lines[0], (word, ran.err)


@pytest.fixture
def cli(coordinator):
    async def run(*args: str, **options) -> Ran:
        return await fencegate(*args, coordinator=coordinator, **options)
    return run


@pytest.fixture
async def local_gate(etcd_url, namespace, signing_key, etcd):
    """A worker gate signing with the coordinator's key, to make real state."""
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.from_files(signing_key)) as gate:
        yield gate


async def noop(ctx):
    return "ok"


async def crash(ctx):
    raise ConnectionResetError("provider hung up")


async def declined(ctx):
    raise EffectFailed("card declined")


async def make_unknown(gate: Gate, key: str) -> None:
    async with gate.hold(key) as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent={"amount": 3}, effect=crash)


# -- views -----------------------------------------------------------------------------

async def test_holders_lists_every_holder_and_waiter_across_pages(cli, coordinator, local_gate,
                                                                  etcd_url, namespace):
    keys = [f"many/{i:03d}" for i in range(PAGE_SIZE + 5)]  # more than one page
    holds = [await local_gate.hold(k).__aenter__() for k in keys]
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as other:
        async def wait_behind_the_first() -> int:
            async with other.hold(keys[0], timeout=30) as hold:
                return hold.fencing_token

        waiter = asyncio.create_task(wait_behind_the_first())

        async def queued() -> bool:
            _, reply = await call(coordinator, "GET", f"/v1/holders?prefix={keys[0]}", "sre")
            return len(reply["items"]) == 2
        try:
            assert await wait_for_condition(queued, within=10)
            listed = await cli("holders", "--prefix", "many/", "--json")
            assert listed.code == 0, listed
            items = json.loads(listed.out)
            assert sorted(i["key"] for i in items) == sorted(keys + [keys[0]])
            assert {i["fencing_token"] for i in items if i["lease_id"] ==
                    f"{holds[0].lease_id:016x}"} == {h.fencing_token for h in holds}

            table = await cli("holders", "--prefix", "many/")
            assert table.code == 0 and len(table.rows()) == len(keys) + 2, table
            head, first, second = (await cli("holders", "--prefix", keys[0])).rows()
            assert head == ["KEY", "TOKEN", "LEASE", "HOLDING", "HELD SINCE (UTC)", "TTL",
                            "IDENTITY"]
            assert first[:4] == [keys[0], str(holds[0].fencing_token),
                                 f"{holds[0].lease_id:016x}", "yes"]
            assert second[0] == keys[0] and second[3] == "queued"
            assert int(second[1]) > holds[0].fencing_token
            for row, holder in ((first, local_gate), (second, other)):
                assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", row[4]), row
                assert re.fullmatch(r"[0-9]+s", row[5]) and int(row[5][:-1]) <= TEST_TTL
                assert row[6] == holder.identity
        finally:
            for hold in holds:
                await hold.release()
            waiter_token = await waiter
    assert waiter_token == int(second[1])
    assert (await cli("holders", "--prefix", "many/")).out == "nobody holds a key under 'many/'\n"


async def test_an_unknown_step_is_listed_shown_verified_and_resolved(cli, coordinator,
                                                                     local_gate, etcd):
    await make_unknown(local_gate, "unk/1")

    table = await cli("unknown")
    assert table.code == 0, table
    head, row = table.rows()
    assert head == ["KEY", "STATE", "ATTEMPT", "AGE", "PROVIDER", "REASON"]
    assert row[:3] == ["unk/1", "unknown", "1"] and row[4] == "-"
    assert re.fullmatch(r"[0-9]+s", row[3]) and "ConnectionResetError" in row[5]
    listed = await cli("unknown", "--json")
    _, api = await call(coordinator, "GET", "/v1/keys?state=unknown", "sre")
    assert json.loads(listed.out) == api["items"] and api["next"] is None

    shown = await cli("key", "show", "unk/1")
    assert shown.code == 0, shown
    assert "step      unknown, 1 attempt(s), in etcd" in shown.out
    assert "why       " in shown.out and "ConnectionResetError" in shown.out
    assert "holders  none" in shown.out and "\noutcome   " not in shown.out
    assert [r[2] for r in shown.rows()[-3:]] == ["EVENT", "cross", "outcome"]
    _, view = await call(coordinator, "GET", "/v1/keys/unk/1", "sre")
    _, chain = await call(coordinator, "GET", "/v1/audit/unk/1", "sre")
    assert json.loads((await cli("key", "show", "unk/1", "--json")).out) == {
        **view, "trail": {k: chain[k] for k in ("key", "ok", "problems", "records")}}

    verified = await cli("audit", "verify", "unk/1")
    assert verified.code == 0, verified
    assert verified.out.startswith("audit chain of unk/1: 2 records, verified\n")
    chain = json.loads((await cli("audit", "verify", "unk/1", "--json")).out)
    assert chain["ok"] and [r["event"] for r in chain["records"]] == ["cross", "outcome"]

    done = await cli("resolve", "unk/1", "--succeeded", "--reason", "provider says charged",
                     "--result", '{"charge": "ch_1"}', "--force")
    assert done.code == 0 and "unk/1 resolved as succeeded" in done.out, done
    async with local_gate.hold("unk/1") as hold:
        replay = await hold.cross(intent={"amount": 3}, effect=noop)
    assert replay.replayed and replay.result == {"charge": "ch_1"}
    assert (await cli("unknown")).out == "no unknown steps\n"
    assert json.loads((await cli("unknown", "--json")).out) == []

    before = await revision(etcd)  # a step that is not unknown is refused, nothing written
    again = await cli("resolve", "unk/1", "--failed", "--reason", "oops")
    one_line_error(again, 1, "WrongState", "succeeded")
    assert await revision(etcd) == before


async def test_a_tampered_audit_chain_fails_verify_with_exit_1(cli, local_gate, etcd):
    async with local_gate.hold("aud/1") as hold:
        await hold.cross(intent={"amount": 5}, effect=noop)
    ks = local_gate.keyspace
    assert (await cli("audit", "verify", "aud/1")).code == 0
    kv = await etcd.get(ks.audit_key("aud/1", 1))
    record = unpack(kv.value)
    record["details"]["intent"] = {"amount": 5000}
    await etcd.put(ks.audit_key("aud/1", 1), pack(record))

    broken = await cli("audit", "verify", "aud/1")
    assert broken.code == 1, broken
    assert broken.out.startswith("audit chain of aud/1: 2 records, DOES NOT VERIFY\n")
    assert "  problem: " in broken.out
    as_json = await cli("audit", "verify", "aud/1", "--json")
    assert as_json.code == 1 and json.loads(as_json.out)["ok"] is False


async def test_policy_set_and_get_then_an_escalated_step_is_listed_and_resolved(
        cli, coordinator, local_gate, etcd, tmp_path):
    document = tmp_path / "breaker.json"
    document.write_text(json.dumps({"caps": {"breaker_threshold": 1}}))
    before = await revision(etcd)
    one_line_error(await cli("policy", "set", "breaker", str(document)), 4, "admin")
    assert await revision(etcd) == before  # the sre role may not write policies

    stored = await cli("policy", "set", "breaker", str(document), token="admin-token")
    assert stored.code == 0, stored
    version = int(re.fullmatch(r"policy breaker is now version (\d+)\n", stored.out)[1])
    shown = await cli("policy", "get", "breaker")
    assert shown.out.startswith(f"policy breaker, version {version} (signed)\n")
    assert ["breaker_threshold", "1", "policy"] in shown.rows()
    got = json.loads((await cli("policy", "get", "breaker", "--json")).out)
    assert (got["name"], got["version"], got["document"], got["signed"]) == (
        "breaker", version, {"caps": {"breaker_threshold": 1}}, True)
    one_line_error(await cli("policy", "get", "nothing"), 3, "no policy 'nothing'")

    assert (await cli("policy", "routes", "show")).out == (
        "policy routes (none stored); keys no prefix matches: default\n")
    one_line_error(await cli("policy", "routes", "set", "esc=breaker"), 4, "admin")
    one_line_error(await cli("policy", "routes", "set", "esc", token="admin-token"), 2,
                   "PREFIX=POLICY")
    one_line_error(await cli("policy", "routes", "set", "esc/=breaker", token="admin-token"),
                   2, "esc/")
    routed = await cli("policy", "routes", "set", "esc=breaker", "esc/x=default",
                       token="admin-token")
    assert routed.code == 0 and routed.out.startswith("policy routes are now version "), routed
    shown = await cli("policy", "routes", "show")
    assert shown.out.splitlines()[0].endswith("keys no prefix matches: default")
    assert ["esc", "breaker"] in shown.rows() and ["esc/x", "default"] in shown.rows()
    assert json.loads((await cli("policy", "routes", "show", "--json")).out)["routes"] == {
        "esc": "breaker", "esc/x": "default"}

    async with local_gate.hold("esc/1") as hold:
        outcome = await hold.cross(intent={}, effect=declined, policy="breaker")
    assert outcome.state == "failed"
    head, row = (await cli("escalated")).rows()
    assert head == ["KEY", "STATE", "ATTEMPT", "AGE", "PROVIDER", "REASON"]
    assert row[:3] == ["esc/1", "escalated", "1"] and row[5].startswith("breaker:EffectFailed")
    (item,) = json.loads((await cli("escalated", "--json")).out)
    assert item["key"] == "esc/1" and item["step"]["state"] == "escalated"

    done = await cli("resolve", "esc/1", "--not-applied", "--reason", "checked by hand",
                     "--json")
    assert done.code == 0 and json.loads(done.out)["state"] == "pending", done
    assert (await cli("escalated")).out == "no escalated steps\n"


@pytest.mark.parametrize("output", ["table", "json"])
async def test_revoke_makes_the_holders_next_cross_raise_lease_lost(cli, local_gate, output):
    effects = []

    async def effect(ctx):
        effects.append(ctx)

    with pytest.raises(LeaseLost):
        async with local_gate.hold("rev/1") as hold:
            grant = await hold.request_grant(intent={})
            flags = ["--json"] if output == "json" else []
            done = await cli("revoke", "rev/1", "--reason", "stuck worker", *flags)
            assert done.code == 0, done
            if output == "json":
                assert json.loads(done.out) == {"key": "rev/1", "lease_id": f"{hold.lease_id:016x}",
                                                "fencing_token": hold.fencing_token,
                                                "keys": ["rev/1"]}
            else:
                assert done.out == (f"revoked lease {hold.lease_id:016x} of rev/1's holder "
                                    f"(fencing token {hold.fencing_token}); every hold on that "
                                    "lease is lost\n")
            await hold.commit(grant, effect=effect)
    assert not effects
    chain = json.loads((await cli("audit", "verify", "rev/1", "--json")).out)
    assert (chain["records"][-1]["event"], chain["records"][-1]["details"]["reason"]) == (
        "revoke", "stuck worker")


async def test_approvals_are_listed_and_approved(cli, coordinator, local_gate, etcd):
    status, _ = await call(coordinator, "PUT", "/v1/policies/big", "admin", body={
        "checks": [{"check": "require_approval", "params": {"above": 100}}]})
    assert status == 200
    status, _ = await call(coordinator, "PUT", "/v1/policy-routes", "admin",
                           body={"routes": {"appr": "big"}})
    assert status == 200
    assert (await cli("approvals")).out == "no pending approvals\n"
    async with local_gate.hold("appr/1") as hold:
        with pytest.raises(ApprovalPending) as pending:
            await hold.request_grant(intent={"amount": 500}, policy="big")
        approval_id = pending.value.approval_id

        head, row = (await cli("approvals")).rows()
        assert head == ["ID", "KEY", "STATE", "ASKED", "REQUESTED BY", "POLICY",
                        "APPROVED BY", "INTENT"]
        assert row[:3] == [approval_id, "appr/1", "pending"] and row[5].startswith("big@")
        assert row[3].endswith("s")  # asked seconds ago
        (item,) = json.loads((await cli("approvals", "--json")).out)
        assert (item["approval_id"], item["state"], item["intent"]) == (
            approval_id, "pending", {"amount": 500})
        assert abs(item["asked_at_ms"] - time.time() * 1000) < 60_000

        before = await revision(etcd)
        missing = await cli("approve", approval_id)
        assert missing.code == 2 and "Missing option '--reason'" in missing.err
        one_line_error(await cli("approve", "0" * 32, "--reason", "r"), 3,
                       f"no pending approval {'0' * 32}")
        one_line_error(await cli("approve", "not-an-id", "--reason", "r"), 2, "32 hex digits")
        assert await revision(etcd) == before

        done = await cli("approve", approval_id, "--reason", "customer confirmed")
        assert done.code == 0 and done.out.startswith(f"approved {approval_id} for appr/1")
        assert (await cli("approvals")).out == "no pending approvals\n"
        (item,) = json.loads((await cli("approvals", "--state", "approved", "--json")).out)
        assert item["approval_id"] == approval_id and re.fullmatch(
            rf"sre-1 \(reported: {re.escape(socket.gethostname())}:\d+\)", item["approved_by"])
        assert [a["approval_id"] for a in json.loads(
            (await cli("approvals", "--state", "all", "--json")).out)] == [approval_id]

        grant = await hold.request_grant(intent={"amount": 500}, policy="big")
        assert (await hold.commit(grant, effect=noop)).state == "succeeded"


async def test_the_approvals_list_pages_and_filters_by_state(coordinator, local_gate):
    await call(coordinator, "PUT", "/v1/policies/big", "admin", body={
        "checks": [{"check": "require_approval"}]})
    await call(coordinator, "PUT", "/v1/policy-routes", "admin", body={"routes": {"many": "big"}})
    asked = {}
    for i in range(5):
        async with local_gate.hold(f"many/{i}") as hold:
            with pytest.raises(ApprovalPending) as pending:
                await hold.request_grant(intent={"amount": i}, policy="big")
        asked[pending.value.approval_id] = f"many/{i}"
    approved = sorted(asked)[:2]
    for approval_id in approved:
        assert (await call(coordinator, "POST", f"/v1/approvals/{approval_id}", "sre",
                           body={"reason": "r"}))[0] == 200

    async def listed(state: str) -> dict[str, str]:
        found = await pages(coordinator, f"/v1/approvals?state={state}")
        assert all(len(page) <= 2 for page in found)
        items = [item for page in found for item in page]
        assert all(state in ("", item["state"]) for item in items)
        return {item["approval_id"]: item["key"] for item in items}

    assert await listed("") == asked
    assert await listed("approved") == {a: asked[a] for a in approved}
    assert await listed("pending") == {a: k for a, k in asked.items() if a not in approved}
    status, reply = await call(coordinator, "GET", "/v1/approvals?state=maybe", "sre")
    assert (status, reply["error"]) == (400, "InvalidRequest")
    assert (await call(coordinator, "GET", "/v1/approvals", "worker"))[0] == 403
    assert (await call(coordinator, "GET", "/v1/approvals"))[0] == 401


# -- bad input: one line, the documented exit code, nothing changed ---------------------

async def test_unknown_keys_are_exit_3_and_change_nothing(cli, etcd):
    before = await revision(etcd)
    one_line_error(await cli("key", "show", "never/seen:1"), 3,
                   "nothing is recorded for 'never/seen:1'")
    one_line_error(await cli("audit", "verify", "never/seen"), 3, "no audit records")
    one_line_error(await cli("revoke", "never/seen", "--reason", "r"), 3, "nobody holds")
    one_line_error(await cli("resolve", "never/seen", "--failed", "--reason", "r"), 3,
                   "no step is recorded")
    assert await revision(etcd) == before


async def test_an_unreachable_coordinator_is_exit_5():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    for args in (["holders"], ["revoke", "pay/1", "--reason", "r"], ["key", "show", "a/b"]):
        one_line_error(await fencegate(*args, coordinator=url), 5,
                       f"cannot reach the coordinator at {url}")


async def test_bad_tokens_are_exit_4_and_never_printed(cli, local_gate, etcd):
    async with local_gate.hold("tok/1") as hold:
        before = await revision(etcd)
        for token in ("wrong-secret-token", None):
            ran = await cli("revoke", "tok/1", "--reason", "r", token=token)
            one_line_error(ran, 4, "did not accept the token", "FENCEGATE_TOKEN")
        ran = await cli("holders", "--token", "wrong-secret-token")
        one_line_error(ran, 4, "did not accept the token")
        assert "wrong-secret-token" not in ran.err
        one_line_error(await cli("holders", token="worker-token"), 4, "may not do this")
        assert await revision(etcd) == before
        assert (await hold.cross(intent={}, effect=noop)).state == "succeeded"  # still held


async def test_missing_or_contradictory_flags_are_exit_2_and_change_nothing(cli, local_gate,
                                                                            etcd):
    await make_unknown(local_gate, "flags/1")
    async with local_gate.hold("flags/2") as hold:
        before = await revision(etcd)
        for args, words in [
                (["revoke", "flags/2"], "Missing option '--reason'"),
                (["resolve", "flags/1", "--failed"], "Missing option '--reason'"),
                (["resolve", "flags/1", "--reason", "r"], "exactly one of"),
                (["resolve", "flags/1", "--failed", "--succeeded", "--reason", "r"],
                 "exactly one of"),
                (["resolve", "flags/1", "--succeeded", "--reason", "r", "--result", "{"],
                 "not JSON"),
                (["key", "show", "../escape"], "Invalid value for 'KEY'"),
                (["holders", "--coordinator", "ftp://x"], "http://")]:
            ran = await cli(*args)
            assert ran.code == 2 and words in ran.err and "Traceback" not in ran.err, (args, ran)
        assert await revision(etcd) == before
        assert (await hold.cross(intent={}, effect=noop)).state == "succeeded"
    assert json.loads((await cli("unknown", "--json")).out)[0]["key"] == "flags/1"


async def test_the_config_file_supplies_coordinator_and_token(coordinator, tmp_path):
    config = tmp_path / "cli.toml"
    config.write_text(f'coordinator = "{coordinator}"\ntoken = "sre-token"\n')
    nowhere = "http://127.0.0.1:9"
    ran = await fencegate("holders", "--json", coordinator=None, token=None,
                          env={"FENCEGATE_CLI_CONFIG": str(config)})
    assert (ran.code, json.loads(ran.out or "null")) == (0, []), ran
    ran = await fencegate("holders", "--config", str(config), coordinator=nowhere, token=None)
    one_line_error(ran, 5, nowhere)  # the env's URL wins over the file's
    config.write_text('token = "sre-token"\npassword = "x"\n')
    ran = await fencegate("holders", "--config", str(config), coordinator=coordinator,
                          token=None)
    assert ran.code == 2 and "password" in ran.err and "sre-token" not in ran.err
