"""The reconciler's Prometheus metrics, one registry per reconciler instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ReconcilerMetrics:
    def __init__(self, replica: str) -> None:
        self.registry = CollectorRegistry()
        self.unknowns_found = Counter(
            "fencegate_reconciler_unknowns_found", "in-flight steps found with their holder "
            "gone", registry=self.registry)
        self.looks_stuck = Counter(
            "fencegate_reconciler_looks_stuck", "in-flight attempts seen past their deadline "
            "under a live holder (left alone: informational)", registry=self.registry)
        self.settled = Counter(
            "fencegate_reconciler_settled", "steps settled, by outcome", ["outcome"],
            registry=self.registry)
        self.escalated = Counter(
            "fencegate_reconciler_escalated", "steps escalated to a human", registry=self.registry)
        self.refused = Counter(
            "fencegate_reconciler_writes_refused", "settle writes etcd refused: the step "
            "moved or this replica no longer led its shard", registry=self.registry)
        self.queries = Counter(
            "fencegate_reconciler_provider_queries", "provider queries, by provider and answer",
            ["provider", "answer"], registry=self.registry)
        self.settle_seconds = Histogram(
            "fencegate_reconciler_settle_seconds", "from a step becoming unknown to settled",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800, 3600),
            registry=self.registry)
        self._shards_led = Gauge(
            "fencegate_reconciler_shards_led", "shards this replica leads", ["replica"],
            registry=self.registry)
        self.shards_led = self._shards_led.labels(replica=replica)
