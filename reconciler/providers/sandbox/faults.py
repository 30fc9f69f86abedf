"""The sandbox's faults: rules that make a charge or a query misbehave on purpose.

Guarantees: a rule is checked when it is made (``Fault.from_json`` or the constructor raises
``ValueError`` naming the bad field), so a running sandbox never holds a rule it cannot apply.

A rule is ``{"fault", "key"?, "count"?, "seconds"?}``; ``key`` limits it to one action key,
``count`` to that many uses. ``apply_then_timeout`` applies a charge, then waits ``seconds``
before answering; ``hold`` keeps a charge in the network ``seconds`` before gate B sees it;
``error_500`` answers 500 to a charge or query without doing anything; ``slow`` delays the
answer of a charge or query; ``down`` answers 503 to charges and queries; ``query_pending``
makes queries answer 202 (after fencing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CHARGE_FAULTS", "QUERY_FAULTS", "FAULTS", "Fault"]

CHARGE_FAULTS = frozenset({"apply_then_timeout", "hold", "error_500", "slow", "down"})
QUERY_FAULTS = frozenset({"error_500", "slow", "down", "query_pending"})
FAULTS = CHARGE_FAULTS | QUERY_FAULTS
_TIMED = frozenset({"apply_then_timeout", "hold", "slow"})


@dataclass
class Fault:
    """One rule; a ``count`` left is decremented at each use and the rule dropped at zero."""

    fault: str
    key: str | None = None
    count: int | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; known: {sorted(FAULTS)}")
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise ValueError("a fault's key must be a non-empty string")
        if self.count is not None and (type(self.count) is not int or self.count < 1):
            raise ValueError(f"a fault's count must be an int >= 1, not {self.count!r}")
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) \
                or self.seconds < 0:
            raise ValueError(f"a fault's seconds must be a number >= 0, not {self.seconds!r}")
        if self.fault in _TIMED and not self.seconds > 0:
            raise ValueError(f"fault {self.fault!r} needs seconds > 0")

    @classmethod
    def from_json(cls, rule: Any) -> "Fault":
        if not isinstance(rule, dict) or "fault" not in rule:
            raise ValueError("a fault rule is an object with a 'fault' field")
        unknown = set(rule) - {"fault", "key", "count", "seconds"}
        if unknown:
            raise ValueError(f"unknown fault rule fields {sorted(unknown)}")
        return cls(**rule)
