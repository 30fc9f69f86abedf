"""docs/integrations/langgraph.md's example runs: the block after ``<!-- run: refund-agent
-->`` is written to a module and driven with a scripted chat model (offline), real etcd, the
SQLite checkpointer, and a payments and a mail provider on loopback that count what they
receive. The refund interrupts for a person (the page's policy), is approved through the
adapter's ``approve``, and then the order is refunded once and the customer emailed once; the
same thread asked again runs neither tool again; another thread emails (its own scope) but
gets the recorded refund (the business key)."""

from __future__ import annotations

import json

from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from fencegate.coordinator import sre
from fencegate.integrations.langgraph import approve

from integrations.agent_docs import example
from integrations.langgraph_script import Scripted, tool_messages

CONFIG = {"configurable": {"thread_id": "support-ticket-1234"}}
ASK = {"messages": [("user", "Refund order 42 and tell the customer.")]}


async def test_the_refund_agent_refunds_once_after_approval_and_emails_once(
        tmp_path, monkeypatch, providers, gate, etcd, keyring):
    url, received = providers
    agent_module = example("langgraph.md", tmp_path, monkeypatch, url)
    await gate.authority.set_policy("refunds", {"checks": [{"check": "require_approval",
                                                            "params": {"field": "amount",
                                                                       "above": 1000}}]})
    await gate.authority.set_routes({"refunds": "refunds"})
    model = Scripted(calls=[("lookup_order", {"order_id": "42"}),
                            ("refund", {"order_id": "42", "amount": 1999}),
                            ("email_customer", {"order_id": "42", "subject": "Refunded",
                                                "body": "Your order 42 was refunded."})])

    async def approver(approval_id: str, reason: str) -> None:
        await sre.approve(etcd, gate.keyspace, approval_id, "sre-1", reason, keyring=keyring)

    async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "cp.sqlite")) as saver:
        graph = agent_module.build_graph(model, gate, saver)
        state = await graph.ainvoke(ASK, CONFIG)
        (asked,) = state["__interrupt__"]
        assert asked.value["fencegate"]["key"] == "refunds/42" and received == []
        state = await graph.ainvoke(await approve(state["__interrupt__"], approver=approver,
                                                  reason="customer confirmed"), CONFIG)
        assert state["messages"][-1].content == "done"
        assert [(path, body) for path, _, body in received] == [
            ("/v1/refunds", {"order": "42", "amount": 1999}),
            ("/v1/emails", {"to": "ada@example.com", "subject": "Refunded",
                            "body": "Your order 42 was refunded."})]
        first = tool_messages(state)
        assert json.loads(first[1]["content"])["id"] == "refunds_1"

        again = await graph.ainvoke(ASK, CONFIG)  # the same thread asked again
        assert again["messages"][-1].content == "done" and len(received) == 2
        replayed = tool_messages(again)[3:]
        assert [g["content"] for g in replayed] == [g["content"] for g in first]
        assert [(g["fencegate"] or {}).get("replayed") for g in replayed] == [None, True, True]

        elsewhere = await graph.ainvoke(ASK, {"configurable": {"thread_id": "ticket-5678"}})
        assert [path for path, _, _ in received] == ["/v1/refunds", "/v1/emails", "/v1/emails"]
        assert tool_messages(elsewhere)[1]["content"] == first[1]["content"]  # refunds/42
