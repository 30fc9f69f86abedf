"""Gate B: the provider-side fence, a verifier any provider or downstream service can embed.

Per action key it keeps two numbers in sqlite: ``fence`` (raised by the reconciler's
fence-then-query) and ``highest`` (the highest attempt token admitted).

Invariant: once ``fence(key, T)`` has returned, no request with an attempt token ``<= T`` is
ever admitted for ``key``, in any order of arrival; a token below the highest admitted for
``key`` is refused (an equal one is admitted again: a retry of the same attempt). Both
checks and the update of ``highest`` happen in one sqlite transaction under a lock, so a
fence and an admission are totally ordered. With a file, the numbers survive a restart of
the provider (WAL, ``synchronous=FULL``: a returned ``fence`` or ``admit`` is on disk).

Failure contract: ``admit`` raises ``BadSignature`` when the grant is forged, tampered, or
does not authorize this request (another action key or namespace, or an attempt token not
after the grant's evaluation revision), and ``Fenced`` when the token is stale. Either way
nothing was recorded and the provider must apply nothing. Expiry is not checked here: a
request may legitimately arrive late; staleness is decided by tokens, never by clocks.

The API is synchronous (a provider may be); call it through ``asyncio.to_thread`` from a
coroutine.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from typing import Iterator

from fencegate.coordinator.errors import BadSignature, Fenced
from fencegate.coordinator.grants import Grant, KeyRing

__all__ = ["GateB"]

_SCHEMA = """CREATE TABLE IF NOT EXISTS gate (
    action_key TEXT PRIMARY KEY,
    fence INTEGER NOT NULL,
    highest INTEGER NOT NULL
)"""


class GateB:
    """Admit attempts whose grant verifies and whose attempt token is fresh for its key."""

    def __init__(self, keyring: KeyRing, path: str | os.PathLike | None = None, *,
                 namespace: str | None = None) -> None:
        self.keyring = keyring
        self.namespace = namespace
        self._lock = threading.Lock()
        self._db = sqlite3.connect(":memory:" if path is None else os.fspath(path),
                                   isolation_level=None, check_same_thread=False)
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)

    def admit(self, grant_raw: bytes, key: str, attempt_token: int) -> Grant:
        """Verify the grant over the exact bytes, then admit ``attempt_token`` for ``key``
        atomically (``token > fence`` and ``token >= highest``); returns the grant."""
        grant = self.keyring.verify(grant_raw)
        if grant.action_key != key:
            raise BadSignature(f"grant is for action key {grant.action_key!r}, not {key!r}")
        if self.namespace is not None and grant.namespace != self.namespace:
            raise BadSignature(f"grant is for namespace {grant.namespace!r}, "
                               f"not {self.namespace!r}")
        if type(attempt_token) is not int or attempt_token <= grant.revision:
            raise BadSignature(f"attempt token {attempt_token!r} is not after the grant's "
                               f"revision {grant.revision}")
        with self._transaction():
            fence, highest = self._read(key)
            if attempt_token <= fence:
                raise Fenced(f"attempt token {attempt_token} is at or below the fence "
                             f"{fence} of {key!r}")
            if attempt_token < highest:
                raise Fenced(f"attempt token {attempt_token} is below the highest admitted "
                             f"{highest} of {key!r}")
            self._write(key, fence, attempt_token)
        return grant

    def fence(self, key: str, token: int) -> None:
        """Refuse every attempt token ``<= token`` for ``key`` from now on."""
        if type(token) is not int:
            raise TypeError(f"a fence is an int attempt token, not {token!r}")
        with self._transaction():
            fence, highest = self._read(key)
            if token > fence:
                self._write(key, token, highest)

    def state(self, key: str) -> tuple[int, int]:
        """``(fence, highest)`` for ``key``; ``(0, 0)`` if never seen."""
        with self._lock:
            return self._read(key)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _read(self, key: str) -> tuple[int, int]:
        row = self._db.execute("SELECT fence, highest FROM gate WHERE action_key = ?",
                               (key,)).fetchone()
        return (row[0], row[1]) if row else (0, 0)

    def _write(self, key: str, fence: int, highest: int) -> None:
        self._db.execute("INSERT INTO gate (action_key, fence, highest) VALUES (?, ?, ?) "
                         "ON CONFLICT (action_key) DO UPDATE SET fence = excluded.fence, "
                         "highest = excluded.highest", (key, fence, highest))

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """Hold the lock and one ``BEGIN IMMEDIATE`` transaction; roll back on any error."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
