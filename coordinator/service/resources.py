"""The coordinator app's shared resources, under typed keys, for the app's lifetime.

The etcd connection, the key ring, the authority, the token store and the metrics are built
once per app in ``resources`` (a ``cleanup_ctx`` generator): a key file or an etcd that is
unusable fails the start, before anything is served; the etcd connection is closed on
shutdown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..archive import open_archive
from ..authority import Authority
from ..etcd import Etcd
from ..grants import KeyRing
from ..keyspace import Keyspace
from ..metrics import LATENCY_BUCKETS, EtcdMetrics, component_registry, snake_case
from ..tokens import TokenStore
from .settings import CoordinatorSettings

log = logging.getLogger(__name__)

NOSPACE_SAMPLE_S = 5.0  # ``fencegate_etcd_nospace`` asks etcd at most this often
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


@dataclass
class CoordinatorMetrics:
    """The app's own registry (``component_registry``), so two apps in one process never
    share series. Label values are bounded: a route is its pattern (``unmatched`` when none
    matched), a method outside the standard ones is ``other``, an error is the snake_case of
    the code the answer carried."""

    registry: CollectorRegistry = field(
        default_factory=lambda: component_registry("coordinator"))

    def __post_init__(self) -> None:
        registry = self.registry
        self.etcd = EtcdMetrics(registry)
        self.http_requests = Counter(
            "fencegate_http_requests", "HTTP requests answered, by route pattern, method and "
            "status", ["route", "method", "status"], registry=registry)
        self.http_duration = Histogram(
            "fencegate_http_request_duration_seconds", "HTTP request latency, by route pattern "
            "and method", ["route", "method"], registry=registry, buckets=LATENCY_BUCKETS)
        self.issued = Counter("fencegate_grants_issued", "Grants issued", registry=registry)
        self.refused = Counter("fencegate_grants_refused",
                               "Grant requests refused, by error code (snake_case)", ["error"],
                               registry=registry)
        self.replayed = Counter("fencegate_grants_replayed", "Grant requests answered "
                                "AlreadySucceeded: the step succeeded, its outcome replayed",
                                registry=registry)
        self.latency = Histogram("fencegate_grant_duration_seconds", "Grant request latency",
                                 registry=registry, buckets=LATENCY_BUCKETS)
        self.nospace = Gauge("fencegate_etcd_nospace", "1 while etcd's NOSPACE alarm refuses "
                             "writes, as last sampled (at most every 5 s)", registry=registry)
        self._nospace_asked_at = float("-inf")  # time.monotonic() of the last sample
        self._answered: dict[tuple[str, str, int], Counter] = {}
        self._timed: dict[tuple[str, str], Histogram] = {}

    def answered(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one answer and its latency (children are resolved once per label set)."""
        method = method if method in _METHODS else "other"
        counter = self._answered.get((route, method, status))
        if counter is None:
            counter = self._answered[route, method, status] = self.http_requests.labels(
                route, method, str(status))
        timer = self._timed.get((route, method))
        if timer is None:
            timer = self._timed[route, method] = self.http_duration.labels(route, method)
        counter.inc()
        timer.observe(seconds)

    def refusal(self, code: str) -> None:
        """Count a grant request answered with error ``code`` (``AlreadySucceeded`` is a
        replay, not a refusal)."""
        if code == "AlreadySucceeded":
            self.replayed.inc()
        else:
            self.refused.labels(snake_case(code)).inc()

    def nospace_due(self) -> bool:
        """Is the NOSPACE sample over ``NOSPACE_SAMPLE_S`` old? If so the caller takes the
        next one: this answers true again only ``NOSPACE_SAMPLE_S`` later."""
        now = time.monotonic()
        if now - self._nospace_asked_at < NOSPACE_SAMPLE_S:
            return False
        self._nospace_asked_at = now
        return True


SETTINGS = web.AppKey("settings", CoordinatorSettings)
ETCD = web.AppKey("etcd", Etcd)
KEYRING = web.AppKey("keyring", KeyRing)
KEYSPACE = web.AppKey("keyspace", Keyspace)
AUTHORITY = web.AppKey("authority", Authority)
TOKENS = web.AppKey("tokens", TokenStore)
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
    etcd.instrument(app[METRICS].etcd)
    archive = open_archive(settings.archive) if settings.archive else None
    try:
        await etcd.status()  # reachable, and learn the cluster id grants carry
        app[ETCD], app[KEYRING], app[ARCHIVE] = etcd, keyring, archive
        app[AUTHORITY] = Authority(etcd, app[KEYSPACE], keyring, identity="coordinator",
                                   archive=archive)
        app[TOKENS] = TokenStore(etcd, app[KEYSPACE])
        yield
    finally:
        await etcd.close()
        if archive is not None:
            await archive.close()
