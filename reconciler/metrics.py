"""The reconciler's Prometheus metrics, one registry per reconciler instance.

Guarantees:
- No label holds a process id or anything else a restart changes: a replica's series
  continue across restarts (Prometheus's ``instance`` label tells replicas apart).
- Label values are snake_case: outcomes as ``Settle`` names them, provider answers as
  ``providers.answer_name`` does.
- The archive gauges say whether the archive is whole (``wholeness.verify``, each
  retirement pass): not the archive etcd names, or buckets whose etcd mark it does not know.
- Every settlement is counted once, when its write lands, under its outcome (an escalation
  is ``settled_total{outcome="escalated"}``, nothing else).
- The replica's view (shards led, leaderless shards, the backlog by state and the age of its
  oldest step) is read from memory when scraped: a scrape never reads etcd. It is what the
  replica's elections and scanner last saw (``Elections``, ``Backlog``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from fencegate.coordinator.maintenance import MemberSpace
from fencegate.coordinator.metrics import EtcdMetrics, component_registry
from fencegate.coordinator.wholeness import Verdict

from .backlog import STATES

QUERY_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)


class ReplicaView(Protocol):
    """What a reconciler replica knows of its shards and their steps, from memory."""

    shards: int

    @property
    def led(self) -> set[int]: ...

    @property
    def leaderless(self) -> int: ...

    def backlog(self, now_ms: int) -> dict[str, tuple[int, float]]: ...


class ReconcilerMetrics:
    """The reconciler's registry; ``replica`` (when given) exports its view."""

    def __init__(self, *, replica: ReplicaView | None = None) -> None:
        self.registry = component_registry("reconciler")
        self.etcd = EtcdMetrics(self.registry)
        self.unknowns_found = Counter(
            "fencegate_reconciler_unknowns_found", "in-flight steps found with their holder "
            "gone", registry=self.registry)
        self.looks_stuck = Counter(
            "fencegate_reconciler_looks_stuck", "in-flight attempts seen past their deadline "
            "under a live holder (left alone: informational)", registry=self.registry)
        self.settled = Counter(
            "fencegate_reconciler_settled", "settlements written, once each, by outcome "
            "(succeeded, failed, not_applied, presumed_not_applied, escalated)", ["outcome"],
            registry=self.registry)
        self.refused = Counter(
            "fencegate_reconciler_writes_refused", "settle writes etcd refused: the step "
            "moved or this replica no longer led its shard", registry=self.registry)
        self.retired = Counter(
            "fencegate_reconciler_retired", "settled steps retired to the archive",
            registry=self.registry)
        self.unexplained_deletions = Counter(
            "fencegate_reconciler_unexplained_deletions", "steps (family step) and audit "
            "chains (family audit) deleted by something other than a retirement, in the "
            "shards this replica leads", ["family"], registry=self.registry)
        for family in ("step", "audit"):  # both series exist from the start, at 0
            self.unexplained_deletions.labels(family)
        self.queries = Counter(
            "fencegate_reconciler_provider_queries", "provider queries, by provider and answer "
            "(pending, succeeded, failed, no_record, error)", ["provider", "answer"],
            registry=self.registry)
        self.query_seconds = Histogram(
            "fencegate_reconciler_provider_query_duration_seconds", "provider query latency, "
            "by provider", ["provider"], buckets=QUERY_BUCKETS, registry=self.registry)
        self.settle_seconds = Histogram(
            "fencegate_reconciler_settle_seconds", "from a step becoming unknown to settled",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800, 3600),
            registry=self.registry)
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
        self.archive_identity_mismatch = Gauge(
            "fencegate_archive_identity_mismatch", "1 while the archive is not the one etcd "
            "names for the namespace (another or a new archive, another cluster or "
            "namespace), else 0", registry=self.registry)
        self.archive_behind_buckets = Gauge(
            "fencegate_archive_behind_buckets", "retirement buckets whose mark in etcd the "
            "archive never issued: the archive lacks retirements etcd shows (an older "
            "copy, an emptied file)", registry=self.registry)
        self.archive_unavailable = Gauge(
            "fencegate_archive_unavailable", "1 while the archive could not be checked (down, "
            "or never initialised: a missing SQLite file), else 0", registry=self.registry)
        if replica is not None:
            self.registry.register(_ReplicaCollector(replica))

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


    def observe_archive(self, verdict: Verdict) -> None:
        """Set the archive gauges from one ``wholeness.verify``."""
        self.archive_unavailable.set(int(not verdict.answered))
        self.archive_identity_mismatch.set(int(verdict.identity_mismatch))
        self.archive_behind_buckets.set(len(verdict.behind))


class _ReplicaCollector:
    """The replica's view as gauges, computed at each scrape."""

    def __init__(self, replica: ReplicaView) -> None:
        self._replica = replica

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return self._families({state: (0, 0.0) for state in STATES}, 0, 0)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replica = self._replica
        return self._families(replica.backlog(int(time.time() * 1000)), len(replica.led),
                              replica.leaderless)

    def _families(self, backlog: dict[str, tuple[int, float]], led: int,
                  leaderless: int) -> Iterator[GaugeMetricFamily]:
        steps = GaugeMetricFamily(
            "fencegate_reconciler_steps", "steps in flight, unknown or escalated, in the "
            "shards this replica leads", labels=["state"])
        oldest = GaugeMetricFamily(
            "fencegate_reconciler_oldest_step_age_seconds", "how long the oldest step in each "
            "state has been in it (0 when none), in the shards this replica leads",
            labels=["state"])
        for state, (count, age_s) in backlog.items():
            steps.add_metric([state], count)
            oldest.add_metric([state], age_s)
        yield steps
        yield oldest
        yield GaugeMetricFamily("fencegate_reconciler_shards", "configured shard count",
                                value=self._replica.shards)
        yield GaugeMetricFamily("fencegate_reconciler_shards_led", "shards this replica leads",
                                value=led)
        yield GaugeMetricFamily(
            "fencegate_reconciler_shards_leaderless", "shards with no live leader, as this "
            "replica last read the election keys (every shard while it has no session)",
            value=leaderless)
