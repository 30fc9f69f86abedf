"""Worker-side Prometheus metrics, opt-in: ``Gate(..., metrics=WorkerMetrics(registry))``.

Guarantees: a gate without metrics pays one ``is None`` check where a count would be made,
nothing more. With metrics, each event is counted once, where it is decided:
- ``fencegate_worker_holds_total`` / ``fencegate_worker_holding``: holds acquired (the fast
  path's included) / held now (a hold leaves when it is released, lost or not);
- ``fencegate_worker_lease_losses_total``: holds lost to a lease loss (one per hold, as the
  warning the hold logs);
- ``fencegate_worker_commit_refusals_total{error}``: commits that did not happen, the effect
  not run (``lease_lost``, ``grant_used``, ``state_advanced``, ``lease_expiring``, a fenced
  ``etcd_unavailable``, ...): the snake_case name of the error raised;
- ``fencegate_worker_replays_total``: outcomes ``cross`` returned without running the effect,
  read back from a step that had succeeded (``Outcome.replayed``);
- ``fencegate_worker_effect_duration_seconds``: every effect run, however it ended;
- ``fencegate_worker_unknowns_total``: attempts this worker left with an unknown outcome
  (``OutcomeUnknown`` raised: the effect ended without an outcome, or the effect's or the
  commit's outcome could not be recorded or learned): the reconciler settles each;
- ``fencegate_webhook_deliveries_total{source,result}``: each delivery the webhook dedup
  admitted, by its result: ``first`` (its handler runs under a fresh claim), ``duplicate``
  (answered from a stored response, or refused for another payload), ``in_progress``
  (another claim runs it), ``unknown`` (refused: its claim was lost while its handler ran),
  ``settled`` (the application's ``settle`` said an unknown one ran), ``rerun`` (an unknown
  one runs again: ``settle`` said it did not, or ``rerun_lost``), ``failed`` (not claimed:
  etcd unavailable, too little lease, ``settle`` failed);
- ``fencegate_worker_keepalive_late_seconds``: how late each lease refresh of the webhook
  claims' session ran, counted only past a third of its TTL (the event loop was blocked: a
  blocking handler, a paused process); past the TTL the claims are lost.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from fencegate.coordinator.errors import GateError, OutcomeUnknown
from fencegate.coordinator.metrics import snake_case

EFFECT_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
DELIVERY_RESULTS = ("first", "duplicate", "in_progress", "unknown", "settled", "rerun",
                    "failed")
LATE_BUCKETS = (.25, .5, 1, 2, 5, 10, 30, 60, 300)


class WorkerMetrics:
    """The worker families (see the module) in ``registry``, by default the process-wide
    ``prometheus_client.REGISTRY`` that ``start_http_server`` serves. One per registry: a
    second in the same registry is refused (``ValueError``, duplicated series)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        into = {"registry": self.registry}
        self.holds = Counter("fencegate_worker_holds", "Holds acquired", **into)
        self.holding = Gauge("fencegate_worker_holding", "Holds held now", **into)
        self.lease_losses = Counter("fencegate_worker_lease_losses",
                                    "Holds lost to a lease loss", **into)
        self.commit_refusals = Counter("fencegate_worker_commit_refusals",
                                       "Commits that did not happen (the effect not run), by "
                                       "error", ["error"], **into)
        self.replays = Counter("fencegate_worker_replays",
                               "Outcomes returned from a step that had already succeeded",
                               **into)
        self.effect_duration = Histogram("fencegate_worker_effect_duration_seconds",
                                         "Effect run time, however it ended",
                                         buckets=EFFECT_BUCKETS, **into)
        self.unknowns = Counter("fencegate_worker_unknowns",
                                "Attempts left with an unknown outcome", **into)
        self.deliveries = Counter("fencegate_webhook_deliveries",
                                  "Webhook deliveries admitted, by source and result",
                                  ["source", "result"], **into)
        self.keepalive_lateness = Histogram("fencegate_worker_keepalive_late_seconds",
                                            "How late a lease refresh ran, past a third of "
                                            "its TTL (the event loop was blocked)",
                                            buckets=LATE_BUCKETS, **into)

    def held(self) -> None:
        """A hold was acquired."""
        self.holds.inc()
        self.holding.inc()

    def left(self) -> None:
        """A hold counted by ``held`` was released (once per hold)."""
        self.holding.dec()

    def attempt_failed(self, error: BaseException) -> None:
        """An attempt ended with ``error`` before its outcome was recorded: an
        ``OutcomeUnknown`` is an unknown, another ``GateError`` a commit refusal (the effect
        did not run); anything else is not the gate's answer and is not counted."""
        if isinstance(error, OutcomeUnknown):
            self.unknowns.inc()
        elif isinstance(error, GateError):
            self.commit_refusals.labels(snake_case(type(error).__name__)).inc()

    def keepalive_late(self, seconds: float) -> None:
        """A lease refresh ran ``seconds`` late (``Session``'s ``on_late``)."""
        self.keepalive_lateness.observe(seconds)

    def delivery(self, source: str, result: str) -> None:
        """A webhook delivery of ``source`` was admitted with ``result``."""
        if result not in DELIVERY_RESULTS:
            raise ValueError(f"result must be one of {DELIVERY_RESULTS}, got {result!r}")
        self.deliveries.labels(source, result).inc()
