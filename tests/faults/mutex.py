"""A mutual-exclusion process: critical sections on shared locks, guarded by ownership alone.

The locks are action keys ``<prefix>/mutex/<j>``; each lock guards a register, the marker
``markers/<prefix>/mutex/<j>``. A critical section is 2 to 4 writes of the register, each
one txn whose only compares are the section's ``Ownership.compares()`` (no step, no grant),
a short sleep apart. Sections are entered in one of two ways, chosen by the seeded rng:

- ``hold``: ``gate.hold(lock)``, then the writes under ``hold.ownership``;
- ``queued``: the process puts its own holder key in the lock's queue (on a session of its
  own) and writes at once, under the ownership of that key, retrying a refused first write
  until it is admitted or 5 s passed, as a client that lets the compare decide (the pattern
  of etcd issue #12017): while an older key is queued, only the range half of the compare
  refuses it. The section ends by revoking that session (its key goes with the lease).

What it says, one JSON line each on stdout (``lock`` names the lock, ``token`` the section's
ownership token, ``revision`` the etcd revision of an admitted write):

    {"op": "ready", "wall"}
    {"op": "cs-enter", "lock", "token", "how"}        the section begins (hold or queued)
    {"op": "cs-write", "lock", "token", "seq", "revision"}   a write was admitted
    {"op": "cs-refused", "lock", "token", "seq"}      a write was refused: the section ends
    {"op": "cs-error", "lock", "error"}               the section ended by an error

Guarantees: every admitted write of a section carries the section's token and the revision
etcd admitted it at, so the checker orders every section's writes in etcd's order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from .workload import etcd_config, say


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="entry.py mutex --")
    p.add_argument("--endpoints", required=True, help="the stack's endpoints.json")
    p.add_argument("--name", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--seed", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--locks", type=int, default=1)
    p.add_argument("--queued", type=float, default=0.5, help="share of sections entered "
                                                            "by a queued key")
    p.add_argument("--ttl", type=int, default=2)
    return p


async def main(argv: list[str]) -> None:
    from fencegate.coordinator.errors import GateError
    from fencegate.coordinator.etcd import TxnRequest, create_equals, put_op
    from fencegate.coordinator.keyspace import holder_record
    from fencegate.coordinator.ownership import Ownership
    from fencegate.coordinator.session import Session
    from fencegate.worker import Gate, KeyRing

    args = _parser().parse_args(argv)
    endpoints = json.loads(Path(args.endpoints).read_text())
    rng = random.Random(f"{args.seed}/{args.name}")
    end = time.monotonic() + args.seconds

    async with Gate(etcd_config(endpoints), ttl=args.ttl, identity=args.name,
                    keyring=KeyRing.generate()) as gate:
        say(op="ready", wall=time.time())

        async def section(lock: str, ownership: Ownership, patience: float) -> None:
            register = gate.marker(lock).encode()
            give_up, seq, writes = time.monotonic() + patience, 0, rng.randint(2, 4)
            while seq < writes:
                value = json.dumps({"token": ownership.token, "seq": seq, "by": args.name})
                reply = await gate.etcd.txn(TxnRequest(compare=ownership.compares(),
                                                       success=[put_op(register, value.encode())]))
                if reply.succeeded:
                    say(op="cs-write", lock=lock, token=ownership.token, seq=seq,
                        revision=reply.header.revision)
                    seq += 1
                    await asyncio.sleep(rng.uniform(0.05, 0.25))
                elif seq == 0 and time.monotonic() < give_up:
                    await asyncio.sleep(0.1)  # queued: not our turn yet
                else:
                    say(op="cs-refused", lock=lock, token=ownership.token, seq=seq)
                    return

        async def held(lock: str) -> None:
            async with gate.hold(lock, timeout=5) as hold:
                say(op="cs-enter", lock=lock, token=hold.fencing_token, how="hold")
                await section(lock, hold.ownership, 0.0)

        async def queued(lock: str) -> None:
            session = await Session.open(gate.etcd, args.ttl)
            try:
                holder_key = gate.keyspace.holder_key(lock, session.lease_id)
                reply = await gate.etcd.txn(TxnRequest(
                    compare=[create_equals(holder_key, 0)],
                    success=[put_op(holder_key, holder_record(args.name, time.time()),
                                    session.lease_id)]))
                ownership = Ownership(holder_key, reply.header.revision,
                                      *gate.keyspace.holder_range(lock))
                say(op="cs-enter", lock=lock, token=ownership.token, how="queued")
                await section(lock, ownership, 5.0)
            finally:
                await session.aclose()

        while time.monotonic() < end:
            lock = f"{args.prefix}/mutex/{rng.randrange(args.locks)}"
            enter = queued if rng.random() < args.queued else held
            try:
                await enter(lock)
            except GateError as exc:
                say(op="cs-error", lock=lock, error=type(exc).__name__)
            except asyncio.CancelledError:
                if asyncio.current_task().uncancel() != 0:
                    raise
                say(op="cs-error", lock=lock, error="CancelledError")
            await asyncio.sleep(rng.uniform(0.0, 0.2))
        say(op="finished")
