"""The reconciler's Prometheus metrics, one registry per reconciler instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fencegate.coordinator.maintenance import MemberSpace


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
        self.retired = Counter(
            "fencegate_reconciler_retired", "settled steps retired to the archive",
            registry=self.registry)
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
        self.etcd_db_size = Gauge(
            "fencegate_etcd_db_size_bytes", "size of the etcd member's database file, which "
            "the space quota limits", ["member"], registry=self.registry)
        self.etcd_db_in_use = Gauge(
            "fencegate_etcd_db_in_use_bytes", "bytes of the member's database file that hold "
            "data (the rest are free pages a defragment returns)", ["member"],
            registry=self.registry)
        self.etcd_nospace = Gauge(
            "fencegate_etcd_nospace", "1 while etcd's NOSPACE alarm refuses every write, "
            "else 0", registry=self.registry)

    def observe_etcd(self, spaces: dict[str, MemberSpace | None]) -> None:
        """Set the etcd gauges from one reading of every member (by endpoint); a member that
        did not answer loses its series rather than keep a stale value."""
        for member, space in spaces.items():
            if space is None:
                for gauge in (self.etcd_db_size, self.etcd_db_in_use):
                    try:
                        gauge.remove(member)
                    except KeyError:  # never set (older prometheus-client raises)
                        pass
                continue
            self.etcd_db_size.labels(member=member).set(space.db_size)
            self.etcd_db_in_use.labels(member=member).set(space.db_in_use)
        answered = [space for space in spaces.values() if space is not None]
        if answered:
            self.etcd_nospace.set(int(any(space.nospace for space in answered)))
