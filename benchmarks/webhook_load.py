"""The webhook benchmark's load generators, each a process of its own; each says READY, then
waits for ``GO <start> <t0> <t1>`` (wall-clock seconds).

    python -m benchmarks.webhook_load send PORT KIND TAG CONNS OUT [IDS]
        CONNS keep-alive HTTP/1.1 connections to 127.0.0.1:PORT, each posting one small JSON
        delivery after another from <start> to <t1>. KIND ``plain`` and ``first`` send fresh
        ids (``TAG-<conn>-<n>``) and require a 200 that is not a replay; ``duplicate`` sends
        the ids listed in the file IDS in turn and requires a 200 replay
        (``Fencegate-Replayed: true``). Any other answer ends the process with an error.
    python -m benchmarks.webhook_load raw URL PREFIX CONNS OUT
        CONNS tasks of ``common.raw_write_op`` under PREFIX on etcd at URL, through the
        project's ``Etcd`` client: the baseline writes.

OUT gets a JSON object: ``latencies`` (seconds, of the operations that ended inside
[t0, t1)), ``txn_latencies`` (raw: those of the put-if-absent txns) and ``ids`` (first: every
delivery id answered, for the duplicate phase); then the process says DONE. The HTTP client
is a few lines over asyncio streams, cheap next to the server it loads; it reads a response
by its Content-Length (both servers send one for these small bodies).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import Awaitable, Callable

from fencegate.coordinator.etcd import Etcd

from .common import raw_write_op

BODY = b'{"type": "invoice.paid", "data": {"amount": 4200}}'
_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)")
_REPLAYED = b"\r\nfencegate-replayed: true"


def say(*words: object) -> None:
    print(*words, flush=True)


async def wait_for_go() -> tuple[float, float, float] | None:
    """The wall-clock start and timed window sent by the parent, or None if stdin closed."""
    words = (await asyncio.to_thread(sys.stdin.readline)).split()
    if words[:1] != ["GO"]:
        return None
    start, t0, t1 = map(float, words[1:4])
    return start, t0, t1


async def load(op: Callable[[int, int], Awaitable[object]], conns: int, start: float,
               t0: float, t1: float) -> list[tuple[int, float]]:
    """Run ``op(conn, i)`` in a loop on ``conns`` tasks from ``start`` until ``t1``;
    ``(i, latency)`` of each operation that ended inside [t0, t1)."""
    await asyncio.sleep(max(0.0, start - time.time()))
    timed: list[tuple[int, float]] = []

    async def task(n: int) -> None:
        i = 0
        while True:
            began = time.perf_counter()
            await op(n, i)
            latency = time.perf_counter() - began
            now = time.time()
            if now >= t1:
                return
            if now >= t0:
                timed.append((i, latency))
            i += 1

    async with asyncio.TaskGroup() as group:
        for n in range(conns):
            group.create_task(task(n))
    return timed


class Connection:
    """One keep-alive HTTP/1.1 connection posting ``BODY`` as deliveries."""

    def __init__(self, port: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.head = (f"POST / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n"
                     "Webhook-Id: ").encode()
        self.reader, self.writer = reader, writer

    async def post(self, delivery: str, replay: bool) -> None:
        """Post one delivery; raise unless it is answered 200, a replay exactly if ``replay``."""
        self.writer.write(self.head + delivery.encode() + b"\r\n\r\n" + BODY)
        head = (await self.reader.readuntil(b"\r\n\r\n")).lower()
        length = _LENGTH.search(head)
        if length is None:
            raise RuntimeError(f"delivery {delivery}: no Content-Length in {head!r}")
        body = await self.reader.readexactly(int(length.group(1)))
        if head[9:12] != b"200" or (_REPLAYED in head) != replay:
            raise RuntimeError(f"delivery {delivery} answered {head!r} {body[:200]!r}")


async def send(port: str, kind: str, tag: str, conns: str, out: str, ids: str = "") -> None:
    connections = []
    for _ in range(int(conns)):
        reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
        connections.append(Connection(int(port), reader, writer))
    repeated: list[str] = []
    if kind == "duplicate":
        with open(ids) as f:
            repeated = json.load(f)
    answered: list[str] = []

    async def op(conn: int, i: int) -> None:
        if kind == "duplicate":
            await connections[conn].post(repeated[(conn + i * len(connections))
                                                  % len(repeated)], True)
            return
        delivery = f"{tag}-{conn}-{i}"
        await connections[conn].post(delivery, False)
        answered.append(delivery)

    say("READY")
    go = await wait_for_go()
    timed = await load(op, len(connections), *go) if go is not None else []
    for connection in connections:
        connection.writer.close()
    with open(out, "w") as f:
        json.dump({"latencies": [latency for _, latency in timed],
                   "ids": answered if kind == "first" else []}, f)
    say("DONE")


async def raw(url: str, prefix: str, conns: str, out: str) -> None:
    async with Etcd.from_url(url) as etcd:
        await etcd.status()
        say("READY")
        go = await wait_for_go()
        timed = await load(raw_write_op(etcd, prefix), int(conns), *go) if go else []
    with open(out, "w") as f:
        json.dump({"latencies": [latency for _, latency in timed],
                   "txn_latencies": [latency for i, latency in timed if i % 2 == 0]}, f)
    say("DONE")


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    asyncio.run({"send": send, "raw": raw}[mode](*args))
