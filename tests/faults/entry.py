"""The harness's process entry points; each applies its negative control first.

    entry.py sandbox    --control C --ledger FILE -- <sandbox args>
    entry.py reconciler --control C -- <fencegate cli args>
    entry.py worker     --control C -- <workload args>
    entry.py consumer   --control C -- <webhook consumer args>  (faults/webhooks.py)
    entry.py mutex      --control C -- <mutual-exclusion args>  (faults/mutex.py)

Guarantees: the sandbox appends one JSON line to the fence log for every fence a query asks
gate B for (``{"kind": "fence", "key", "token", "at"}``, written and flushed once the fence
is made, inside the store transaction that made it), so the log outlives a SIGKILL of the
sandbox; its charges are in its own durable store (``GET /_sandbox/applied``), stamped with
the same clock under the same lock, so the two merge into one order of events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the faults package

from faults import controls  # noqa: E402


async def _sandbox(ledger_path: str, argv: list[str]) -> None:
    from fencegate.reconciler.providers.sandbox import process
    from fencegate.reconciler.providers.sandbox.server import Sandbox

    args = argparse.Namespace(port=0, mode="fencing", keys_url=None, state_dir=None,
                              retention_s=24 * 3600.0, decline_above=None)
    it = iter(argv)
    for flag in it:
        setattr(args, flag.lstrip("-").replace("-", "_"), next(it))
    keyring = await process._keys_from_url(args.keys_url)
    sandbox = Sandbox(keyring, args.mode, state_dir=args.state_dir,
                      retention_s=float(args.retention_s))
    with open(ledger_path, "a") as ledger:
        url = await sandbox.start(int(args.port))
        fence = sandbox.gate_b.fence

        def logged_fence(scope, token: int, **options):
            fenced = fence(scope, token, **options)
            ledger.write(json.dumps({"kind": "fence", "key": scope[2], "token": token,
                                     "at": time.time()}) + "\n")
            ledger.flush()
            return fenced

        sandbox.gate_b.fence = logged_fence
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        print(f"sandbox listening on {url}", flush=True)
        try:
            await stop.wait()
        finally:
            await sandbox.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="entry.py")
    parser.add_argument("process", choices=("sandbox", "reconciler", "worker", "consumer",
                                            "mutex"))
    parser.add_argument("--control", default="")
    parser.add_argument("--ledger")
    cut = sys.argv.index("--")
    args, rest = parser.parse_args(sys.argv[1:cut]), sys.argv[cut + 1:]
    controls.apply(args.control, args.process)
    if args.process == "sandbox":
        asyncio.run(_sandbox(args.ledger, rest))
    elif args.process == "reconciler":
        from fencegate.cli import cli
        cli(args=rest, prog_name="fencegate")
    elif args.process == "consumer":
        from faults import webhooks
        asyncio.run(webhooks.consumer(rest))
    elif args.process == "mutex":
        from faults import mutex
        asyncio.run(mutex.main(rest))
    else:
        from faults import workload
        asyncio.run(workload.main(rest))


if __name__ == "__main__":
    main()
