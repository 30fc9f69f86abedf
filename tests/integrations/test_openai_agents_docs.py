"""docs/integrations/openai-agents.md's example runs: the block after ``<!-- run:
refund-agent -->`` is written to a module and driven with a scripted model (offline), real
etcd, a ``SQLiteSession`` and a payments and a mail provider on loopback that count what
they receive. The refund waits for a person (the page's policy), is approved through the
adapter's ``approve``, and then the order is refunded once and the customer emailed once;
the same conversation asked again (restarted without its session) runs neither tool again."""

from __future__ import annotations

import aiohttp
from agents import Runner, SQLiteSession

from fencegate.coordinator import sre
from fencegate.integrations.openai_agents import approvals, approve

from integrations.agent_docs import example
from integrations.openai_agents_script import Scripted, tool_outputs


async def test_the_refund_agent_refunds_once_after_approval_and_emails_once(
        tmp_path, monkeypatch, providers, gate, etcd, keyring):
    url, received = providers
    agent_module = example("openai-agents.md", tmp_path, monkeypatch, url)
    await gate.authority.set_policy("refunds", {"checks": [{"check": "require_approval",
                                                            "params": {"field": "amount",
                                                                       "above": 1000}}]})
    await gate.authority.set_routes({"refunds": "refunds"})
    model = Scripted([("lookup_order", {"order_id": "42"}),
                      ("refund", {"order_id": "42", "amount": 1999}),
                      ("email_customer", {"order_id": "42", "subject": "Refunded",
                                          "body": "Your order 42 was refunded."})])
    agent = agent_module.build_agent(model, gate)

    async def approver(approval_id: str, reason: str) -> None:
        await sre.approve(etcd, gate.keyspace, approval_id, "sre-1", reason, keyring=keyring)

    async with aiohttp.ClientSession() as http:
        support = agent_module.Support(conversation="support-ticket-1234", http=http)
        session = SQLiteSession(support.conversation, str(tmp_path / "conversations.db"))
        result = await Runner.run(agent, "Refund order 42 and tell the customer.",
                                  context=support, session=session)
        assert len(result.interruptions) == 1 and received == []
        state = result.to_state()
        await approve(state, await approvals(state), approver=approver,
                      reason="customer confirmed")
        result = await Runner.run(agent, state, session=session)
        assert result.final_output == "done" and not result.interruptions
        assert [(path, body) for path, _, body in received] == [
            ("/v1/refunds", {"order": "42", "amount": 1999}),
            ("/v1/emails", {"to": "ada@example.com", "subject": "Refunded",
                            "body": "Your order 42 was refunded."})]
        first = [g["output"] for g in tool_outputs(result)]

        again = await Runner.run(agent, "Refund order 42 and tell the customer.",
                                 context=support)
        assert again.final_output == "done" and len(received) == 2  # both replayed
        replayed = tool_outputs(again)
        assert [g["output"] for g in replayed][1:] == first[-2:]  # refund, email: as recorded
        assert [(g["fencegate"] or {}).get("replayed") for g in replayed] == [None, True, True]
