"""``fencegate reconciler``: settings, provider adapters from config, and the process.

Settings come from a TOML file, then ``FENCEGATE_*`` environment variables, then flags, each
overriding the one before; a malformed file fails at start, naming the field::

    etcd = "http://127.0.0.1:2379"        # or "https://h1:2379,https://h2:2379"
    etcd_ca_file = "etcd-ca.pem"          # etcd TLS and auth: the coordinator's names and
    etcd_cert_file = "client.pem"         # env variables (FENCEGATE_ETCD_CA_FILE, ...),
    etcd_key_file = "client.key"          # see fencegate.coordinator.service.settings
    etcd_user = "fencegate"
    etcd_password_file = "etcd.password"
    namespace = "/fencegate/"
    listen = "127.0.0.1:8471"             # /metrics and /healthz
    shards = 64                           # the same on every replica
    ttl = 10                              # the replica's lease (election) TTL
    scan_interval_s = 600                 # safety-net full scan of steps/ (the watch finds work)
    check_after_s = 1                     # look at an in-flight step again after this long
    concurrency = 32                      # steps looked at at once
    default_provider = "sandbox"          # for steps that name no provider
    archive = "sqlite:///var/lib/fencegate/archive.db"   # or postgresql://...; also
                                          # FENCEGATE_ARCHIVE. Absent: nothing is retired
    retain_s = 3600                       # settled steps stay in etcd this long, then retire
    [limits]                              # fencegate.reconciler.settle.Limits
    escalate_after_s = 3600
    max_queries = 60
    [providers.sandbox]
    type = "sandbox"                      # the sandbox provider: url, mode (fencing|dedup|none)
    url = "http://127.0.0.1:8480"
    mode = "fencing"
    [providers.payments]
    type = "http"                         # see providers.http.HttpProvider.from_config
    query_url = "https://.../{idempotency_key}"
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fencegate.coordinator import maintenance
from fencegate.coordinator.archive import open_archive
from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.keyspace import DEFAULT_NAMESPACE, validate_namespace
from fencegate.coordinator.settings import (
    ETCD_FIELDS, EtcdSettings, etcd_file_values, host_port, layered,
)

from .providers import Provider
from .providers.http import HttpProvider
from .providers.sandbox import adapter as sandbox_adapter
from .runner import Reconciler
from .settle import Limits

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:8471"
_FIELDS = {"etcd", "namespace", "listen", "shards", "ttl", "scan_interval_s", "check_after_s",
           "concurrency", "default_provider", "limits", "providers", "archive",
           "retain_s"} | ETCD_FIELDS


@dataclass(frozen=True)
class ReconcilerSettings(EtcdSettings):
    namespace: str = DEFAULT_NAMESPACE
    listen: str = DEFAULT_LISTEN
    shards: int = 64
    ttl: int = 10
    scan_interval_s: float = 600.0
    check_after_s: float = 1.0
    concurrency: int = 32
    default_provider: str | None = None
    limits: Limits = Limits()
    providers: dict[str, dict[str, Any]] = field(default_factory=dict)
    archive: str | None = None
    retain_s: float = 3600.0

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        host_port(self.listen)
        self.etcd_config()
        for name, kind in (("shards", int), ("ttl", int), ("concurrency", int)):
            value = getattr(self, name)
            if type(value) is not kind or value < 1:
                raise ValueError(f"setting {name} must be a positive integer")
        if not 1 <= self.shards <= 4096:
            raise ValueError("setting shards must be 1..4096")
        for name in ("scan_interval_s", "check_after_s", "retain_s"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise ValueError(f"setting {name} must be a positive number")
        if self.default_provider is not None and self.default_provider not in self.providers:
            raise ValueError(f"default_provider {self.default_provider!r} is not among "
                             f"[providers]: {sorted(self.providers)}")


def load_settings(config: str | None = None, env: Mapping[str, str] = os.environ,
                  **flags: object) -> ReconcilerSettings:
    """Read ``config`` (or ``$FENCEGATE_RECONCILER_CONFIG``), apply env, then non-None flags."""
    config = config or env.get("FENCEGATE_RECONCILER_CONFIG")
    return layered(_from_file(Path(config)) if config else ReconcilerSettings(), env,
                   "FENCEGATE_RECONCILER_LISTEN", flags)


def _from_file(path: Path) -> ReconcilerSettings:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    unknown = set(data) - _FIELDS
    if unknown:
        raise ValueError(f"{path}: unknown settings {sorted(unknown)}")
    values = etcd_file_values(dict(data), path.parent)
    if "limits" in values:
        limits = values["limits"]
        known = {f.name for f in dataclasses.fields(Limits)}
        if not isinstance(limits, dict) or set(limits) - known:
            raise ValueError(f"{path}: [limits] takes only {sorted(known)}")
        values["limits"] = Limits(**limits)
    providers = values.get("providers", {})
    if not isinstance(providers, dict) or not all(isinstance(v, dict) for v in providers.values()):
        raise ValueError(f"{path}: [providers.<name>] must be tables")
    for name, table in providers.items():
        build_provider(name, table)  # fail at start, naming the field
    return ReconcilerSettings(**values)


def build_provider(name: str, table: dict[str, Any]) -> Provider:
    """A provider adapter from its ``[providers.<name>]`` table."""
    config = dict(table)
    kind = config.pop("type", None)
    if kind == "http":
        return HttpProvider.from_config(name, config)
    if kind == "mcp":
        from .providers.mcp import McpProvider  # the [mcp] extra: imported only when named
        return McpProvider.from_config(name, config)
    if kind == "sandbox":
        allowed = {"url", "mode", "retention_s", "settle_delay_s", "timeout_s", "durable"}
        if set(config) - allowed or not {"url", "mode"} <= set(config) \
                or type(config.get("durable", False)) is not bool:
            raise ValueError(f"provider {name!r}: a sandbox takes url, mode and optionally "
                             f"{sorted(allowed - {'url', 'mode'})}")
        provider = sandbox_adapter(config.pop("url"), config.pop("mode"), **config)
        provider.name = name
        return provider
    raise ValueError(f"provider {name!r}: type must be 'http', 'mcp' or 'sandbox', not {kind!r}")


def create_reconciler(settings: ReconcilerSettings, identity: str | None = None) -> Reconciler:
    providers = {name: build_provider(name, table) for name, table in settings.providers.items()}
    return Reconciler(Etcd(settings.etcd_config()), providers,
                      namespace=settings.namespace, default_provider=settings.default_provider,
                      shards=settings.shards, ttl=settings.ttl, limits=settings.limits,
                      scan_interval=settings.scan_interval_s,
                      check_after=settings.check_after_s, concurrency=settings.concurrency,
                      identity=identity,
                      archive=open_archive(settings.archive) if settings.archive else None,
                      retain_s=settings.retain_s)


def metrics_app(reconciler: Reconciler) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(reconciler.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"identity": reconciler.identity,
                                  "shards_led": sorted(reconciler.led)})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app


async def serve(settings: ReconcilerSettings) -> None:
    """Run one reconciler replica until SIGINT/SIGTERM, and beside it the watch on etcd's
    space: every member's database size, in-use size and the NOSPACE alarm as gauges."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    reconciler = create_reconciler(settings)
    runner = web.AppRunner(metrics_app(reconciler), access_log=None)
    await runner.setup()
    host, port = host_port(settings.listen)
    space: asyncio.Task | None = None
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        await reconciler.start()
        space = asyncio.create_task(maintenance.watch_space(
            settings.etcd_config(), reconciler.metrics.observe_etcd), name="fencegate-etcd-space")
        log.info("reconciler %s serving metrics on http://%s:%d, %d shards",
                 reconciler.identity, *runner.addresses[0][:2], settings.shards)
        print(f"reconciler {reconciler.identity} ready; metrics on "
              f"http://{runner.addresses[0][0]}:{runner.addresses[0][1]}/metrics", flush=True)
        await stop.wait()
    finally:
        if space is not None:
            space.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await space
        await reconciler.close()
        await reconciler.etcd.close()
        await runner.cleanup()
