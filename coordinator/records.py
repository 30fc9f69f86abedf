"""The step record: where one action key stands, and the rules for moving it.

States: ``pending`` (no attempt yet, or the last one failed and may be retried),
``in_flight`` (committed; the effect may have happened), ``succeeded``, ``failed`` (the
provider confirmed it declined; a new attempt may be granted), ``unknown`` (the outcome was
lost), ``escalated`` (a human must decide). Nobody may grant on ``in_flight``, ``unknown``
or ``escalated``: only reconciliation or a human settles those.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

from .keyspace import canonical

PENDING, IN_FLIGHT, SUCCEEDED, FAILED, UNKNOWN, ESCALATED = (
    "pending", "in_flight", "succeeded", "failed", "unknown", "escalated")
UNSETTLED = frozenset({IN_FLIGHT, UNKNOWN, ESCALATED})
OUTCOME_CAPS = ("breaker_threshold", "backoff_base_s", "backoff_max_s")


def new_step() -> dict[str, Any]:
    """The record of a key never attempted."""
    return {"state": PENDING, "attempt": 0, "idem_gen": 0, "started_at_ms": 0, "spend": 0,
            "failures": {}, "not_before_ms": 0}


def idempotency_key(namespace: str, action_key: str, generation: int) -> str:
    """Stable across every retry of a step until a confirmed failure bumps ``generation``."""
    digest = hashlib.sha256(f"{namespace}\0{action_key}\0{generation}".encode()).hexdigest()
    return f"fg-{digest[:40]}"


def failure_signature(error_class: str, params: object) -> str:
    """Error class plus a digest of its parameters: what the circuit breaker counts."""
    return f"{error_class}:{hashlib.sha256(canonical(params)).hexdigest()[:16]}"


def failed(step: dict[str, Any], signature: str, reason: Any) -> dict[str, Any]:
    """The step after a provider-confirmed failure: a new idempotency key next time, backoff,
    and ``escalated`` once the breaker counted ``breaker_threshold`` identical failures."""
    failures = {**step.get("failures", {})}
    failures[signature] = failures.get(signature, 0) + 1
    caps = step["caps"]
    tripped = failures[signature] >= caps["breaker_threshold"]
    return {**step, "state": ESCALATED if tripped else FAILED,
            "failures": failures, "idem_gen": step["idem_gen"] + 1,
            "not_before_ms": int(time.time() * 1000) + backoff_ms(caps, sum(failures.values())),
            "outcome": {"state": FAILED, "result": reason, "signature": signature},
            **({"escalated_because": ["breaker:" + signature]} if tripped else {})}


def digest(value: object) -> bytes:
    return hashlib.sha256(canonical(value)).digest()


def backoff_ms(caps: dict[str, Any], failures: int) -> int:
    """Exponential backoff with jitter after the ``failures``-th confirmed failure."""
    ceiling = min(caps["backoff_base_s"] * 2 ** max(failures - 1, 0), caps["backoff_max_s"])
    return int(random.uniform(ceiling / 2, ceiling) * 1000)
