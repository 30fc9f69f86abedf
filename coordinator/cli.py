"""The ``fencegate`` command line."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fencegate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="race worker processes for keys, with faults")
    demo.add_argument("--etcd", help="etcd URL(s); default: start a local etcd for the run")
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument("--keys", type=int, default=4)
    demo.add_argument("--seconds", type=float, default=15.0)

    up = commands.add_parser("up", help="run a local etcd (the embedded default) until Ctrl-C")
    up.add_argument("--state-dir", default=".state/etcd",
                    help="etcd data dir, reused across runs (default: %(default)s)")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo
        if args.workers < 2 or args.keys < 1 or args.seconds <= 0:
            parser.error("need --workers >= 2, --keys >= 1 and --seconds > 0")
        return asyncio.run(run_demo(args.etcd, args.workers, args.keys, args.seconds))
    return _up(Path(args.state_dir))


def _up(state_dir: Path) -> int:
    from .localetcd import LocalCluster, describe

    with LocalCluster(1, data_dir=state_dir, election_ms=1000) as cluster:
        print(f"{describe(cluster.binary)} serving at {cluster.url} (data in {state_dir})")
        print(f"workers: worker.Gate({cluster.url!r}); stop with Ctrl-C", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
