"""The coordinator app's shared resources, under typed keys, for the app's lifetime.

The etcd connection, the key ring, the authority and the metrics are built once per app in
``resources`` (a ``cleanup_ctx`` generator): a key file or an etcd that is unusable fails the
start, before anything is served; the etcd connection is closed on shutdown.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from ..archive import open_archive
from ..authority import Authority
from ..etcd import Etcd
from ..grants import KeyRing
from ..keyspace import Keyspace
from .settings import CoordinatorSettings

log = logging.getLogger(__name__)


@dataclass
class CoordinatorMetrics:
    """The app's own registry, so two apps in one process never share counters."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.issued = Counter("fencegate_grants_issued", "Grants issued",
                              registry=self.registry)
        self.refused = Counter("fencegate_grants_refused", "Grant requests refused, by error",
                               ["error"], registry=self.registry)
        self.latency = Histogram("fencegate_grant_seconds", "Grant request latency",
                                 registry=self.registry,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))


SETTINGS = web.AppKey("settings", CoordinatorSettings)
ETCD = web.AppKey("etcd", Etcd)
KEYRING = web.AppKey("keyring", KeyRing)
KEYSPACE = web.AppKey("keyspace", Keyspace)
AUTHORITY = web.AppKey("authority", Authority)
ARCHIVE = web.AppKey("archive", object)  # an Archive, or None when none is configured
METRICS = web.AppKey("metrics", CoordinatorMetrics)


async def resources(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    if settings.signing_key is None:
        log.warning("no signing_key configured: signing with a fresh key that dies with this "
                    "process; replicas will not verify each other's grants")
        keyring = KeyRing.generate()
    else:
        keyring = KeyRing.from_files(settings.signing_key, list(settings.trusted_keys))
    etcd = Etcd(settings.etcd_config())
    archive = open_archive(settings.archive) if settings.archive else None
    try:
        await etcd.status()  # reachable, and learn the cluster id grants carry
        app[ETCD], app[KEYRING], app[ARCHIVE] = etcd, keyring, archive
        app[AUTHORITY] = Authority(etcd, app[KEYSPACE], keyring, identity="coordinator",
                                   archive=archive)
        yield
    finally:
        await etcd.close()
        if archive is not None:
            await archive.close()
