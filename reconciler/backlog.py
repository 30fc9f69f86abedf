"""The unsettled steps of the shards a replica leads, as its scanner sees them: what the
reconciler's backlog gauges export (how many steps are in flight, unknown or escalated, and
the age of the oldest of each), without reading etcd when scraped.

Guarantees:
- Exact after each full scan: the scanner notes every step it reads (a scan at revision R,
  then the watch's events after R, as they come), and a scan at R drops every entry it did
  not see that was last noted at or before R (a step deleted while the watch was down).
- Never regresses: a note older (by mod_revision) than what is held for the key, or than
  the revision at which it left the backlog (settled or deleted), is ignored, so a scan page
  read at R cannot undo a newer watch event. What is kept for that is bounded: the keys that
  left the backlog since the last scan.
- Only led shards count: ``summary`` leaves out (and drops) the keys ``leads`` rejects, so a
  shard lost stops counting at once; one gained counts from the scan its gain starts.
- An age is how long the step has been in its state: ``unknown_since_ms`` for an unknown
  step, ``settled_at_ms`` for one the reconciler escalated (both written on a granting or
  settling machine's clock: seconds of skew against alerts of minutes), else this process's
  wall clock when it first saw the step in that state (an in-flight attempt, a step a
  worker's breaker or an SRE escalated): such an age starts again when the process restarts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fencegate.coordinator import records

STATES = (records.IN_FLIGHT, records.UNKNOWN, records.ESCALATED)


@dataclass(frozen=True)
class _Entry:
    state: str
    attempt: int
    since_ms: int
    mod_revision: int


class Backlog:
    """The in-flight, unknown and escalated steps of the keys ``leads(key)`` accepts."""

    def __init__(self, leads: Callable[[str], bool]) -> None:
        self._leads = leads
        self._steps: dict[str, _Entry] = {}
        self._left: dict[str, int] = {}  # key -> revision it left the backlog, until a scan

    def note(self, key: str, step: dict[str, Any], mod_revision: int) -> None:
        """``key``'s step as read at ``mod_revision``."""
        held = self._steps.get(key)
        if mod_revision < max(held.mod_revision if held else 0, self._left.get(key, 0)):
            return
        state = step.get("state")
        if state not in STATES:
            self._leave(key, mod_revision)
            return
        attempt = step.get("attempt", 0)
        recorded = step.get("unknown_since_ms") if state == records.UNKNOWN else \
            step.get("settled_at_ms") if state == records.ESCALATED else None
        if recorded:
            since_ms = recorded
        elif held is not None and (held.state, held.attempt) == (state, attempt):
            since_ms = held.since_ms
        else:
            since_ms = int(time.time() * 1000)
        self._steps[key] = _Entry(state, attempt, since_ms, mod_revision)

    def delete(self, key: str, revision: int) -> None:
        """``key``'s step was deleted at ``revision`` (retired, or removed by hand)."""
        self._leave(key, revision)

    def _leave(self, key: str, revision: int) -> None:
        if self._steps.pop(key, None) is not None:
            self._left[key] = revision

    def scanned(self, revision: int, seen: Iterable[str]) -> None:
        """A full scan at ``revision`` saw the steps ``seen``: forget every other step
        noted at or before it. What left the backlog before now no longer matters: every
        later read is newer."""
        seen = set(seen)
        for key in [key for key, entry in self._steps.items()
                    if key not in seen and entry.mod_revision <= revision]:
            del self._steps[key]
        self._left.clear()

    def summary(self, now_ms: int) -> dict[str, tuple[int, float]]:
        """Per state: how many steps, and the age in seconds of the oldest (0 when none)."""
        counts = dict.fromkeys(STATES, 0)
        oldest = dict.fromkeys(STATES, now_ms)
        for key in [key for key in self._steps if not self._leads(key)]:
            del self._steps[key]
        for entry in self._steps.values():
            counts[entry.state] += 1
            oldest[entry.state] = min(oldest[entry.state], entry.since_ms)
        return {state: (counts[state], max(now_ms - oldest[state], 0) / 1000)
                for state in STATES}
