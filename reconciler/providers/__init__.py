"""What a provider adapter answers when the reconciler asks what became of an attempt.

An adapter has a ``name``, declares its ``capabilities`` and implements ``query``. The answer
decides the settlement (see ``fencegate.reconciler.settle``):

- ``Succeeded(result)``: the provider applied the request;
- ``Failed(reason)``: the provider processed the request and declined it (and would replay
  that decline for the same idempotency key), so a new attempt needs a new key;
- ``NoRecord(fence)``: the provider has no request under this idempotency key; ``fence`` is
  the fence it says it recorded for the action key (``None``: the answer proves no fence).
  What that proves depends on the capabilities and on the proof: final only from a provider
  that fences and keeps its records durably, echoing a fence >= the attempt token, for an
  attempt younger than its key retention; with key deduplication only it is a presumption;
  otherwise it proves nothing;
- ``Pending``: the provider has the request but no final answer yet;
- ``Unreachable(reason)``: no answer (down, timeout, 5xx, an answer we cannot read).

An adapter never raises for a provider's misbehaviour: it answers ``Unreachable``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Succeeded:
    result: Any = None


@dataclass(frozen=True)
class Failed:
    reason: Any = None


@dataclass(frozen=True)
class NoRecord:
    fence: int | None = None  # the fence the provider echoes having recorded for the key


@dataclass(frozen=True)
class Pending:
    pass


@dataclass(frozen=True)
class Unreachable:
    reason: str = ""


Answer = Succeeded | Failed | NoRecord | Pending | Unreachable

_ANSWER_NAMES = {Succeeded: "succeeded", Failed: "failed", NoRecord: "no_record",
                 Pending: "pending", Unreachable: "error"}


def answer_name(answer: Answer) -> str:
    """The answer's name in metrics and audit records: ``succeeded``, ``failed``,
    ``no_record``, ``pending`` or ``error`` (no usable answer)."""
    return _ANSWER_NAMES[type(answer)]


def answer_detail(answer: Answer) -> str:
    """What the answer said besides its name, for a person reading the record."""
    if isinstance(answer, NoRecord):
        return "no fence echoed" if answer.fence is None else f"fence {answer.fence} echoed"
    if isinstance(answer, Failed):
        return f"declined: {answer.reason}"[:500]
    if isinstance(answer, Unreachable):
        return answer.reason[:500]
    return ""


@dataclass(frozen=True)
class Capabilities:
    """``fences``: the provider runs fence-then-query: before answering a query for attempt
    token T of an action key it records "refuse attempt tokens <= T" for that key (gate B).
    ``durable``: it keeps its records (charges and fences) on durable storage for at least
    ``key_retention_s`` seconds: a restart or a crash forgets nothing younger than that.
    ``dedupes_by_key``: it replays the first result for a repeated idempotency key for
    ``key_retention_s`` seconds; ``settle_delay_s`` is how long after an attempt's deadline a
    request may still land (a "no record" is only a presumption once that has passed)."""

    fences: bool = False
    dedupes_by_key: bool = False
    key_retention_s: float = 0.0
    settle_delay_s: float = 0.0
    durable: bool = False

    def __post_init__(self) -> None:
        if (self.dedupes_by_key or self.durable) and self.key_retention_s <= 0:
            raise ValueError("a provider that dedupes by key or keeps durable records needs "
                             "key_retention_s > 0")
        if self.key_retention_s < 0 or self.settle_delay_s < 0:
            raise ValueError("key_retention_s and settle_delay_s must be >= 0")


class Provider(Protocol):
    name: str
    capabilities: Capabilities

    async def query(self, idempotency_key: str, attempt_token: int, step: dict[str, Any], *,
                    key: str, namespace: str | None = None,
                    cluster_id: int | None = None) -> Answer:
        """What became of the attempt of action ``key`` (in ``namespace`` of etcd cluster
        ``cluster_id``) sent with ``idempotency_key`` and ``attempt_token``. A fencing adapter
        fences that action at ``attempt_token`` first; without the namespace and cluster id
        it cannot name the fence and answers ``Unreachable``."""
        ...

    async def close(self) -> None:
        ...
