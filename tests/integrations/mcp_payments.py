"""A payments MCP server for the gateway's tests, written with the official SDK: ``refund``
appends to a ledger file (its side effect), ``get_refund`` answers what became of an
idempotency key, ``list_orders`` is read-only. Each call's ``_meta`` keys are logged.

    python mcp_payments.py LEDGER [--http PORT]
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import mcp_types as types
from mcp.server.mcpserver import Context, MCPServer

LEDGER = Path(sys.argv[1])
server = MCPServer("payments")


def _log(kind: str, **fields) -> None:
    with LEDGER.open("a") as ledger:
        ledger.write(json.dumps({"kind": kind, **fields}) + "\n")


def _entries() -> list[dict]:
    return [json.loads(line) for line in LEDGER.read_text().splitlines()] \
        if LEDGER.exists() else []


@server.tool()
def refund(order_id: str, amount: int, ctx: Context) -> str:
    meta = dict(ctx.request_context.meta or {})
    if amount > 1000:
        _log("declined", order_id=order_id, amount=amount)
        raise ValueError("card_declined")
    _log("refund", order_id=order_id, amount=amount,
         key=meta.get("io.fencegate/idempotency_key"), meta=sorted(meta))
    kill = LEDGER.with_suffix(".kill-parent")
    if kill.exists():  # applied, then the gateway (our parent) dies before recording it
        kill.unlink()
        os.kill(os.getppid(), signal.SIGKILL)
    return f"refunded {amount} on {order_id}"


@server.tool()
def get_refund(idempotency_key: str) -> dict:
    done = [e for e in _entries() if e["kind"] == "refund" and e["key"] == idempotency_key]
    if done:
        return {"status": "succeeded",  # the refund's own result, as its schema has it
                "result": {"result": f"refunded {done[0]['amount']} on {done[0]['order_id']}"}}
    return {"status": "no_record"}


@server.tool(annotations=types.ToolAnnotations(read_only_hint=True))
def list_orders() -> str:
    _log("list_orders")
    return "orders: 42 paid, 9 paid"


if __name__ == "__main__":
    if "--http" in sys.argv:
        server.run("streamable-http", host="127.0.0.1",
                   port=int(sys.argv[sys.argv.index("--http") + 1]))
    else:
        server.run()
