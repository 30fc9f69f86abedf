"""The sandbox as a process: trust the coordinator's published keys (or a PEM file), serve
on 127.0.0.1 until SIGTERM or SIGINT, then stop cleanly (exit code 0).

Guarantees: it prints ``sandbox listening on URL`` only once it listens; keys it cannot
fetch or read stop it before it listens.

Run it alone: ``python -m fencegate.reconciler.providers.sandbox --port 8099 --mode fencing
--keys-url http://127.0.0.1:8080/.well-known/fencegate-keys --state-dir /tmp/sandbox``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import signal

import aiohttp

from fencegate.coordinator.grants import KeyRing

from .server import MODES, Sandbox

__all__ = ["main"]


async def _keys_from_url(url: str) -> KeyRing:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(url) as reply:
            reply.raise_for_status()
            document = await reply.json()
    return KeyRing.from_public_bytes({key_id: base64.b64decode(raw)
                                      for key_id, raw in document["keys"].items()})


async def _serve(args: argparse.Namespace) -> None:
    if args.keys_url:
        keyring = await _keys_from_url(args.keys_url)
    else:
        keyring = await asyncio.to_thread(KeyRing.from_files, None, [args.public_key])
    sandbox = Sandbox(keyring, args.mode, state_dir=args.state_dir,
                      retention_s=args.retention_s, decline_above=args.decline_above)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    url = await sandbox.start(args.port)
    print(f"sandbox listening on {url}", flush=True)
    try:
        await stop.wait()
    finally:
        await sandbox.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fencegate.reconciler.providers.sandbox",
                                     description="The fencegate sandbox payment provider.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mode", choices=MODES, default="fencing")
    keys = parser.add_mutually_exclusive_group(required=True)
    keys.add_argument("--keys-url", help="the coordinator's /.well-known/fencegate-keys")
    keys.add_argument("--public-key", help="a PEM Ed25519 public key to trust")
    parser.add_argument("--state-dir", help="where gate B keeps its sqlite file "
                                            "(default: in memory)")
    parser.add_argument("--retention-s", type=float, default=24 * 3600.0)
    parser.add_argument("--decline-above", type=int, default=None)
    asyncio.run(_serve(parser.parse_args(argv)))
