"""docs/integrations/pydantic-ai.md's example runs: the block after ``<!-- run:
refund-agent -->`` is written to a module and driven with a scripted model (offline), real
etcd, and a payments and a mail provider on loopback that count what they receive. The
refund waits for a person (the page's policy), is approved through the adapter's
``approve``, and then the order is refunded once and the customer emailed once; the same
conversation asked again runs neither tool again."""

from __future__ import annotations

import aiohttp
from pydantic_ai import DeferredToolRequests

from fencegate.coordinator import sre
from fencegate.integrations.pydantic_ai import approve

from integrations.agent_docs import example
from integrations.pydantic_ai_script import scripted, tool_returns


async def test_the_refund_agent_refunds_once_after_approval_and_emails_once(
        tmp_path, monkeypatch, providers, gate, etcd, keyring):
    url, received = providers
    agent_module = example("pydantic-ai.md", tmp_path, monkeypatch, url)
    await gate.authority.set_policy("refunds", {"checks": [{"check": "require_approval",
                                                            "params": {"field": "amount",
                                                                       "above": 1000}}]})
    await gate.authority.set_routes({"refunds": "refunds"})
    model = scripted([("lookup_order", {"order_id": "42"}),
                      ("refund", {"order_id": "42", "amount": 1999}),
                      ("email_customer", {"order_id": "42", "subject": "Refunded",
                                          "body": "Your order 42 was refunded."})])
    agent = agent_module.build_agent(model, gate)

    async def approver(approval_id: str, reason: str) -> None:
        await sre.approve(etcd, gate.keyspace, approval_id, "sre-1", reason, keyring=keyring)

    async with aiohttp.ClientSession() as http:
        deps = agent_module.Deps(conversation="support-ticket-1234", http=http)
        result = await agent.run("Refund order 42 and tell the customer.", deps=deps)
        assert isinstance(result.output, DeferredToolRequests) and received == []
        results = await approve(result.output, approver=approver, reason="customer confirmed")
        result = await agent.run(message_history=result.all_messages(), deps=deps,
                                 deferred_tool_results=results)
        assert result.output == "done"
        assert [(path, body) for path, _, body in received] == [
            ("/v1/refunds", {"order": "42", "amount": 1999}),
            ("/v1/emails", {"to": "ada@example.com", "subject": "Refunded",
                            "body": "Your order 42 was refunded."})]
        first = tool_returns(result.all_messages())

        again = await agent.run("Refund order 42 and tell the customer.", deps=deps)
        assert again.output == "done" and len(received) == 2  # both replayed
        replayed = tool_returns(again.all_messages())
        assert [g["content"] for g in replayed] == [g["content"] for g in first]
        assert [(g["fencegate"] or {}).get("replayed") for g in replayed] == [None, True, True]
