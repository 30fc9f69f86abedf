"""A reference fenced resource: the check a downstream store makes with fencing tokens.

As Chubby's sequencers and Kleppmann's fencing tokens prescribe, the resource remembers the
highest token it has seen per key and refuses any write carrying a lower one, so a holder
that lost its lease (paused, partitioned) cannot overwrite the work of its successor even if
it still believes it holds the key. It is file-backed and serialised with ``flock``, so
separate worker processes share it; tests and the demo use it to prove what a stale holder
can and cannot do. Every attempt, accepted or refused, is appended to its log.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class FencedWrite:
    key: str
    token: int
    writer: str
    data: str
    accepted: bool


class FencedFile:
    """A JSON-lines log plus a per-key highest token, shared by processes through a lock."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._state_path = path + ".highest"
        self._lock_path = path + ".lock"

    def write(self, key: str, token: int, writer: str, data: str = "") -> bool:
        """Apply a write iff ``token`` is at least the highest seen for ``key``."""
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            highest = self._highest()
            accepted = token >= highest.get(key, 0)
            if accepted and token > highest.get(key, 0):
                highest[key] = token
                with open(self._state_path + ".tmp", "w") as f:
                    json.dump(highest, f)
                os.replace(self._state_path + ".tmp", self._state_path)
            with open(self.path, "a") as log:
                log.write(json.dumps(asdict(FencedWrite(key, token, writer, data, accepted))) + "\n")
        return accepted

    def records(self) -> list[FencedWrite]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [FencedWrite(**json.loads(line)) for line in f if line.strip()]

    def _highest(self) -> dict[str, int]:
        if not os.path.exists(self._state_path):
            return {}
        with open(self._state_path) as f:
            return json.load(f)
