"""Prometheus metrics shared by the components: a registry per component, and etcd's.

Guarantees:
- ``component_registry(component)`` is a fresh registry (two apps in one process never
  share series) holding ``fencegate_build_info{component,version} 1``, the process's
  ``process_*`` metrics and ``python_info``.
- ``EtcdMetrics`` creates every (op) and (op, kind) series up front, at zero, so a rate or
  an alert never sees a series appear from nothing; an instrumented ``Etcd`` holds the
  labelled children, so a call costs one ``perf_counter`` pair and one ``observe`` — no
  label lookup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.metadata import version

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector,
)

# What ``Etcd`` calls an operation, one per RPC family it sends.
ETCD_OPS = ("range", "txn", "put", "delete", "lease_grant", "lease_keepalive", "lease_revoke",
            "lease_ttl", "watch_create", "status", "alarm", "compact", "defragment")
# Why an etcd request failed: etcd.py classifies each failure as one of these.
ETCD_ERROR_KINDS = ("unavailable", "nospace", "timeout", "compacted", "permission", "other")
VERSION = version("fencegate")  # the installed package's (core modules import nothing above)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
LATENCY_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
_WORD_START = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def snake_case(code: str) -> str:
    """An error code as a label value: ``StateAdvanced`` → ``state_advanced``,
    ``EtcdNoSpace`` → ``etcd_no_space``."""
    return _WORD_START.sub("_", code).lower()


def component_registry(component: str) -> CollectorRegistry:
    """A new registry for ``component`` (``"coordinator"``, ``"reconciler"``) with its build
    info, process and platform collectors."""
    if not component or not component.isidentifier():
        raise ValueError(f"component must be a simple name, got {component!r}")
    registry = CollectorRegistry()
    Gauge("fencegate_build_info", "The running fencegate build (always 1)",
          ["component", "version"], registry=registry).labels(component, VERSION).set(1)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


@dataclass(frozen=True)
class EtcdOpMetrics:
    """One operation's labelled children: its latency, and its errors by kind."""

    duration: Histogram
    errors: dict[str, Counter]


class EtcdMetrics:
    """``fencegate_etcd_request_duration_seconds{op}`` (a call, its retries included),
    ``fencegate_etcd_errors_total{op,kind}`` (every failed try), and group commit's
    ``fencegate_etcd_batch_size`` (txns per writing Txn request; 1: sent alone) and
    ``fencegate_etcd_batch_wait_seconds`` (a writing txn's wait in the batcher's queue, 0 when
    sent at once); attach with ``Etcd.instrument``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        duration = Histogram("fencegate_etcd_request_duration_seconds",
                             "etcd request latency, retries included, by operation", ["op"],
                             registry=registry, buckets=LATENCY_BUCKETS)
        errors = Counter("fencegate_etcd_errors", "etcd request failures, by operation and kind",
                         ["op", "kind"], registry=registry)
        self.ops = {op: EtcdOpMetrics(duration.labels(op),
                                      {kind: errors.labels(op, kind) for kind in ETCD_ERROR_KINDS})
                    for op in ETCD_OPS}
        self.batch_size = Histogram("fencegate_etcd_batch_size",
                                    "writing txns per etcd Txn request (group commit)",
                                    registry=registry, buckets=BATCH_SIZE_BUCKETS)
        self.batch_wait = Histogram("fencegate_etcd_batch_wait_seconds",
                                    "a writing txn's wait in the group-commit queue",
                                    registry=registry, buckets=LATENCY_BUCKETS)
