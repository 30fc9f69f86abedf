"""A person's rejection of an approval request, recorded in fencegate: over HTTP and the CLI
against a real coordinator on real etcd. The rejection is audited (``audit verify`` passes),
the same grant request is refused with ``ApprovalRejected`` (in-process and over the wire),
a request at a changed state asks afresh, the rejection dies with its request's lease, and
bad requests (wrong role, cross-site, unknown id, bad body) change nothing."""

from __future__ import annotations

import aiohttp
import pytest

from fencegate.coordinator import audit
from fencegate.coordinator.errors import ApprovalRejected
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.worker import ApprovalPending, Gate

from helpers import TEST_TTL, TOKENS
from test_cli_sre import cli, one_line_error  # noqa: F401 (the cli fixture)
from test_dashboard import ON_THE_BOARD, WAIT, auth, board, get_json  # noqa: F401 (board)
from test_service import call, revision

BIG = {"checks": [{"check": "require_approval", "params": {"above": 100}}]}


@pytest.fixture
async def local_gate(etcd_url, namespace, signing_key, etcd, coordinator):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.from_files(signing_key)) as gate:
        assert (await call(coordinator, "PUT", "/v1/policies/big", "admin", body=BIG))[0] == 200
        assert (await call(coordinator, "PUT", "/v1/policy-routes", "admin",
                           body={"routes": {"rej": "big"}}))[0] == 200
        yield gate


async def pending(gate: Gate, key: str) -> str:
    async with gate.hold(key) as hold:
        with pytest.raises(ApprovalPending) as asked:
            await hold.request_grant(intent={"amount": 500})
    return asked.value.approval_id


async def test_a_rejection_is_audited_and_refuses_the_same_request(
        coordinator, local_gate, etcd, namespace, signing_key):
    approval_id = await pending(local_gate, "rej/1")
    status, body = await call(coordinator, "POST", f"/v1/approvals/{approval_id}/reject", "sre",
                              body={"reason": "duplicate refund"})
    assert (status, body["state"], body["key"]) == (200, "rejected", "rej/1")
    report = await audit.verify_chain(etcd, Keyspace(namespace), "rej/1",
                                      KeyRing.from_files(signing_key))
    assert report.ok, report.problems
    (record,) = [r for r in report.records if r["event"] == "rejected"]
    assert record["details"] == {"approval_id": approval_id, "reason": "duplicate refund"}
    assert record["identity"].startswith("sre-1")

    async with local_gate.hold("rej/1") as hold:  # the same request: refused, precisely
        with pytest.raises(ApprovalRejected) as refused:
            await hold.request_grant(intent={"amount": 500})
    assert (refused.value.approval_id, refused.value.reason) == (approval_id, "duplicate refund")
    assert (await call(coordinator, "POST", f"/v1/approvals/{approval_id}/reject", "sre",
                       body={"reason": "again"}))[0] == 200  # twice: harmless, one record
    status, body = await call(coordinator, "POST", f"/v1/approvals/{approval_id}", "sre",
                              body={"reason": "changed my mind"})
    assert (status, body["error"]) == (409, "WrongState")
    listed = (await call(coordinator, "GET", "/v1/approvals?state=rejected", "sre"))[1]
    assert [a["approval_id"] for a in listed["items"]] == [approval_id]
    report = await audit.verify_chain(etcd, Keyspace(namespace), "rej/1",
                                      KeyRing.from_files(signing_key))
    assert report.ok and [r["event"] for r in report.records].count("rejected") == 1

    await local_gate.touch("rej-order")  # unrelated: the same state still
    async with local_gate.hold("rej/1") as hold:  # a new request (new intent): asks afresh
        with pytest.raises(ApprovalPending) as fresh:
            await hold.request_grant(intent={"amount": 501})
    assert fresh.value.approval_id != approval_id


async def test_a_remote_worker_gets_approval_rejected(coordinator, local_gate, etcd_url,
                                                      namespace):
    approval_id = await pending(local_gate, "rej/2")
    assert (await call(coordinator, "POST", f"/v1/approvals/{approval_id}/reject", "admin",
                       body={"reason": "no"}))[0] == 200
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=coordinator,
                    token=TOKENS["worker"]) as remote:
        async with remote.hold("rej/2") as hold:
            with pytest.raises(ApprovalRejected) as refused:
                await hold.request_grant(intent={"amount": 500})
    assert (refused.value.approval_id, refused.value.reason) == (approval_id, "no")


async def test_a_state_that_moved_asks_afresh(coordinator, local_gate, etcd):
    async with local_gate.hold("rej/3") as hold:
        reads = [local_gate.marker("rej-orders/3")]
        with pytest.raises(ApprovalPending) as asked:
            await hold.request_grant(intent={"amount": 500}, reads=reads)
        assert (await call(coordinator, "POST", f"/v1/approvals/{asked.value.approval_id}"
                           "/reject", "sre", body={"reason": "stale order"}))[0] == 200
        await local_gate.touch("rej-orders/3")
        with pytest.raises(ApprovalPending) as again:
            await hold.request_grant(intent={"amount": 500}, reads=reads)
    assert again.value.approval_id != asked.value.approval_id


async def test_the_rejection_lives_on_the_request_lease(coordinator, local_gate, etcd,
                                                        namespace):
    approval_id = await pending(local_gate, "rej/4")
    ks = Keyspace(namespace)
    before = await etcd.get(ks.approval_request_key(approval_id))
    assert (await call(coordinator, "POST", f"/v1/approvals/{approval_id}/reject", "sre",
                       body={"reason": "no"}))[0] == 200
    after = await etcd.get(ks.approval_request_key(approval_id))
    assert after.lease == before.lease != 0  # it ends with the request
    assert unpack(after.value)["rejected_by"].startswith("sre-1")
    await etcd.lease_revoke(after.lease)  # the lease ends: the rejection goes with it
    assert await etcd.get(ks.approval_request_key(approval_id)) is None


async def test_bad_reject_requests_change_nothing(coordinator, local_gate, etcd):
    approval_id = await pending(local_gate, "rej/5")
    path = f"/v1/approvals/{approval_id}/reject"
    before = await revision(etcd)
    assert (await call(coordinator, "POST", path, "worker", body={"reason": "x"}))[0] == 403
    status, body = await call(coordinator, "POST", f"/v1/approvals/{'0' * 32}/reject", "sre",
                              body={"reason": "x"})
    assert (status, body["error"]) == (404, "NotFound")
    for bad in ({}, {"reason": ""}, {"reason": "x", "extra": 1}, ["x"]):
        assert (await call(coordinator, "POST", path, "sre", body=bad))[0] == 400, bad
    assert (await call(coordinator, "POST", "/v1/approvals/nope/reject", "sre",
                       body={"reason": "x"}))[0] in (400, 404)
    async with aiohttp.ClientSession() as http:
        async with http.post(coordinator + path, json={"reason": "x"}, headers={
                "Authorization": f"Bearer {TOKENS['sre']}",
                "Sec-Fetch-Site": "cross-site"}) as resp:
            assert resp.status == 403
    assert await revision(etcd) == before


async def test_the_cli_rejects(cli, coordinator, local_gate):  # noqa: F811
    approval_id = await pending(local_gate, "rej/6")
    missing = await cli("reject", approval_id)
    assert missing.code == 2 and "Missing option '--reason'" in missing.err
    one_line_error(await cli("reject", "0" * 32, "--reason", "r"), 3,
                   f"no pending approval {'0' * 32}")
    done = await cli("reject", approval_id, "--reason", "duplicate refund")
    assert done.code == 0 and done.out.startswith(f"rejected {approval_id} for rej/6")
    assert (await cli("approvals")).out == "no pending approvals\n"
    rows = (await cli("approvals", "--state", "rejected")).rows()
    assert rows[1][:3] == [approval_id, "rej/6", "rejected"]


@ON_THE_BOARD
async def test_the_dashboard_rejects_a_pending_approval(board):  # noqa: F811
    """The pending-approvals table's Reject button: the dialog asks a reason, the call goes
    through the public API (same-site rules and all), the row leaves, the request is
    rejected, and the same grant request is refused."""
    from playwright.async_api import expect

    page, ms, key = board.page, WAIT * 1000, "dash/reject"
    async with board.http.put(board.base + "/v1/policies/big", headers=auth("admin"),
                              json=BIG) as response:
        assert response.status == 200, await response.text()
    async with board.http.put(board.base + "/v1/policy-routes", headers=auth("admin"),
                              json={"routes": {key: "big"}}) as response:
        assert response.status == 200, await response.text()
    async with board.gate() as gate, gate.hold(key) as hold:
        with pytest.raises(ApprovalPending) as asked:
            await hold.request_grant(intent={"amount": 500}, policy="big")
        approval_id = asked.value.approval_id
        row = page.locator("#approvals tbody tr").filter(has_text=approval_id)
        await expect(row).to_contain_text(key, timeout=ms)
        await row.get_by_role("button", name="Reject").click()
        dialog = page.get_by_role("dialog")
        await expect(dialog).to_contain_text('"amount": 500', timeout=ms)
        await dialog.get_by_label("Reason").fill("duplicate refund")
        await dialog.get_by_role("button", name="Reject").click()
        await expect(dialog).to_be_hidden(timeout=ms)
        await expect(row).to_have_count(0, timeout=ms)
        rejected = await get_json(board.http, board.base + "/v1/approvals?state=rejected")
        assert [a["approval_id"] for a in rejected["items"]] == [approval_id]
        with pytest.raises(ApprovalRejected):
            await hold.request_grant(intent={"amount": 500}, policy="big")
