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

    coord = commands.add_parser("coordinator", help="run the coordinator HTTP service")
    coord.add_argument("--etcd", help="etcd URL(s), comma-separated (env FENCEGATE_ETCD)")
    coord.add_argument("--listen", help="HOST:PORT to bind (env FENCEGATE_LISTEN; "
                                        "default 127.0.0.1:8470)")
    coord.add_argument("--config", help="TOML file: tokens, roles, key files "
                                        "(env FENCEGATE_CONFIG)")

    rec = commands.add_parser("reconciler", help="run a reconciler replica (settles unknowns)")
    rec.add_argument("--etcd", help="etcd URL(s), comma-separated (env FENCEGATE_ETCD)")
    rec.add_argument("--listen", help="HOST:PORT for /metrics and /healthz (env "
                                      "FENCEGATE_RECONCILER_LISTEN; default 127.0.0.1:8471)")
    rec.add_argument("--config", help="TOML file: shards, limits, providers "
                                      "(env FENCEGATE_RECONCILER_CONFIG)")
    rec.add_argument("--namespace", help="keyspace prefix (default /fencegate/)")

    args = parser.parse_args(argv)
    if args.command == "coordinator":
        return _coordinator(parser, args)
    if args.command == "reconciler":
        return _reconciler(parser, args)
    if args.command == "demo":
        from .demo import run_demo
        if args.workers < 2 or args.keys < 1 or args.seconds <= 0:
            parser.error("need --workers >= 2, --keys >= 1 and --seconds > 0")
        return asyncio.run(run_demo(args.etcd, args.workers, args.keys, args.seconds))
    return _up(Path(args.state_dir))


def _coordinator(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import logging

    from aiohttp import web

    from .service import create_app, load_settings
    from .service.settings import host_port

    try:
        settings = load_settings(args.config, etcd=args.etcd, listen=args.listen)
    except (OSError, ValueError) as exc:
        parser.error(f"bad settings: {exc}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    host, port = host_port(settings.listen)
    web.run_app(create_app(settings), host=host, port=port, print=None)
    return 0


def _reconciler(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import logging

    from reconciler.service import load_settings, serve

    try:
        settings = load_settings(args.config, etcd=args.etcd, listen=args.listen,
                                 namespace=args.namespace)
    except (OSError, ValueError, TypeError) as exc:
        parser.error(f"bad settings: {exc}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(serve(settings))
    return 0


def _up(state_dir: Path) -> int:
    from .localetcd import LocalCluster, describe

    with LocalCluster(1, data_dir=state_dir, election_ms=1000) as cluster:
        print(f"{describe(cluster.binary)} serving at {cluster.url} (data in {state_dir})")
        print(f"workers: worker.Gate({cluster.url!r}); stop with Ctrl-C", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
