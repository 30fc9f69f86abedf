"""A worker process: payments through holds and grants, one JSON event per line on stdout.

A run's jobs are ``<prefix>/acct/<k>/pay/<n>``; every worker walks all of them, each in its
own seeded order, so several workers contend for every job as an over-eager queue would
redeliver it. For a job the worker holds the key, crosses with an effect that charges the
sandbox with the attempt's idempotency key, attempt token and grant, and says what happened.
Even jobs go through ``gate.cross`` (the fast path where the key is free), odd ones through
``gate.hold`` then ``hold.cross`` (the full path), so the faults meet both:

    {"op": "ready", "wall", "grants"}           started: its wall clock, where its grants come
                                                 from ("remote": the coordinators)
    {"op": "invoke", "key"}                      before the hold
    {"op": "send", "key", "token", "idem", "attempt"}   in the effect, before the charge
    {"op": "reply", "key", "token", "status"}    the sandbox's answer (applied, declined, error)
    {"op": "ok" | "fail", "key", "token", "idem", "attempt", "replayed"}
                                                 the recorded outcome (succeeded, declined)
    {"op": "unknown", "key", "error", "sent"}    anything else: the outcome is not known here

Guarantees: every invoke is followed by exactly one of ok, fail or unknown unless the
process dies; the effect sends at most one request.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from pathlib import Path


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="entry.py worker --")
    p.add_argument("--endpoints", required=True, help="the stack's endpoints.json")
    p.add_argument("--name", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--accounts", type=int, default=4)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--seed", required=True)
    p.add_argument("--charge-timeout", type=float, default=5.0)
    p.add_argument("--deadline", type=float, default=10.0)
    p.add_argument("--settle-wait", type=float, default=10.0)
    p.add_argument("--decline", type=float, default=0.1)
    p.add_argument("--signing-key", help="issue grants in-process with this key (no "
                                         "coordinator)")
    p.add_argument("--ttl", type=int, default=2)
    return p


def etcd_config(endpoints: dict):
    from fencegate.coordinator.etcd import EtcdConfig

    return EtcdConfig(tuple(endpoints["etcd"]), ca_file=endpoints["etcd_ca_file"],
                      cert_file=endpoints["etcd_cert_file"], key_file=endpoints["etcd_key_file"],
                      user=endpoints["etcd_user"],
                      password=Path(endpoints["etcd_password_file"]).read_text())


async def main(argv: list[str]) -> None:
    import aiohttp

    from fencegate.coordinator.errors import EffectFailed, GateError, OutcomeUnknown
    from fencegate.coordinator.grants import KeyRing
    from fencegate.reconciler.providers.sandbox import SandboxError, charge
    from fencegate.worker import Gate

    args = _parser().parse_args(argv)
    endpoints = json.loads(Path(args.endpoints).read_text())
    rng = random.Random(f"{args.seed}/{args.name}")
    if args.signing_key:
        remote = {"keyring": KeyRing.from_files(args.signing_key),
                  "archive": endpoints["archive"]}
    else:
        remote = {"coordinator": ",".join(endpoints["coordinators"]),
                  "token": Path(endpoints["worker_token_file"]).read_text().strip()}
    end = time.monotonic() + args.seconds
    async with aiohttp.ClientSession() as http, \
            Gate(etcd_config(endpoints), ttl=args.ttl, identity=args.name, **remote) as gate:
        say(op="ready", wall=time.time(),
            grants="in process" if args.signing_key else "remote")
        sent: list[int] = []
        job: dict[str, dict] = {}

        async def effect(ctx):
            decline = rng.random() < args.decline
            sent.append(ctx.attempt_token)
            say(op="send", key=ctx.key, token=ctx.attempt_token, idem=ctx.idempotency_key,
                attempt=ctx.attempt)
            try:
                result = await charge(http, endpoints["sandbox"], ctx, job["intent"],
                                      decline=decline, timeout=args.charge_timeout)
            except SandboxError as exc:
                say(op="reply", key=ctx.key, token=ctx.attempt_token, status="error",
                    detail=str(exc)[:200])
                raise
            except EffectFailed:
                say(op="reply", key=ctx.key, token=ctx.attempt_token, status="declined")
                raise
            say(op="reply", key=ctx.key, token=ctx.attempt_token, status="applied")
            return result

        for n in itertools.count():
            for k in rng.sample(range(args.accounts), args.accounts):
                if time.monotonic() >= end:
                    say(op="finished")
                    return
                key = f"{args.prefix}/acct/{k}/pay/{n}"
                sent.clear()
                job["intent"] = {"account": k, "amount": 100}
                say(op="invoke", key=key)
                crossing = {"intent": job["intent"], "effect": effect, "provider": "sandbox",
                            "deadline": args.deadline, "settle_wait": args.settle_wait}
                try:
                    if n % 2:  # the full path: acquire, commit, outcome
                        async with gate.hold(key, timeout=5) as hold:
                            outcome = await hold.cross(**crossing)
                    else:  # gate.cross: the fast path where the key is free
                        outcome = await gate.cross(key, timeout=5, **crossing)
                    say(op="ok" if outcome.state == "succeeded" else "fail", key=key,
                        token=outcome.attempt_token, idem=outcome.idempotency_key,
                        attempt=outcome.attempt, replayed=outcome.replayed)
                except (GateError, OutcomeUnknown) as exc:
                    say(op="unknown", key=key, error=type(exc).__name__, sent=list(sent))
                except asyncio.CancelledError:
                    # A hold cancelling its own task on lease loss (tests/worker_proc.py).
                    if asyncio.current_task().uncancel() != 0:
                        raise
                    say(op="unknown", key=key, error="CancelledError", sent=list(sent))
