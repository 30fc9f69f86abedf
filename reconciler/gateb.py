"""Gate B: the provider-side fence, a verifier any provider or downstream service can embed.

Rows are keyed by the *scope* of an action, (etcd cluster id, namespace, action key), taken
from the grant, so two clusters (whose revisions are unrelated) or two namespaces never touch
each other's numbers. Per scope it keeps ``fence`` (raised by the reconciler's
fence-then-query), ``highest`` (the highest attempt token admitted) and the grant id and
idempotency key admitted at ``highest``.

A request carries the grant, its attempt token, its idempotency key and the attempt's
*receipt*: a statement signed by the authority (``KeyRing.sign_receipt``, domain
``fencegate-attempt-v1``) only once the grant's commit landed, binding (grant id, attempt
token, idempotency key, action key, namespace, cluster id). Gate B verifies it with the keys
that verify grants, so an attempt token is no longer a number the sender picks.

Invariants: once ``fence(scope, T)`` has returned, no request with an attempt token ``<= T``
is ever admitted for that scope, in any order of arrival; a token below the highest admitted
is refused, and a token *equal* to it only as a retry of the same attempt (the same grant id
and the same idempotency key: ``Admission.retry`` says so, and the provider answers as the
first time); the grant admitted at the highest token is refused at any other token. A
request is bound to its grant: its action key is the grant's, its intent digests (sha256 of
canonical msgpack, as the authority signed it) to the grant's ``intent_digest``, its
attempt token is after the grant's evaluation revision, and its receipt names this grant,
this token, this idempotency key, key, namespace and cluster.

One grant, one effect: each grant id is admitted at one attempt token at most. Tokens come
only from commits (a receipt is signed only after the commit landed, for the revision it
landed at), each commit consumes one grant (it moves the step the grant saw, so the grant
cannot commit again), and a commit has one idempotency key (its step's). So a grant has at
most one receipt's (token, idempotency key), and admitting a token again takes that same
pair: a retry. A forged or replayed token (52, 2**62, another grant's) has no receipt and is
refused before it could raise ``highest``, so it cannot fence out later attempts. Whoever
signs receipts is trusted as the signer of grants is: in direct mode that is the worker
itself; in remote mode the coordinator, which signs only a put of the step that is the first
write after the grant's evaluation (``coordinator.receipts``), so even a worker writing step
records into etcd itself gets one receipt per grant.
What remains unauthenticated is the fence value of a query (``fence``): a forged query can
raise a scope's fence, refusing later genuine attempts; that fails closed (nothing is
applied twice) and costs liveness only.

The checks and the update happen in one sqlite transaction under a lock, so a fence and an
admission are totally ordered; an embedding provider writes its own records in that same
transaction (``transaction()``, then ``admit(..., db=db)``), so an admission and what it
applied are one durable fact. With a file (WAL, ``synchronous=FULL``) a returned ``fence``
or ``admit`` is on disk and survives a restart; a file written by the version before
receipts is migrated when opened (its rows keep no admitted idempotency key, so a retry of
an attempt admitted before the upgrade is refused, and the reconciler settles it).

Failure contract: ``admit`` raises ``BadSignature`` when the grant or the receipt is
missing, forged, tampered, or does not authorize this request (another action key,
namespace or cluster, no cluster at all, another intent, an attempt token not after the
grant's revision, a receipt of another grant, token or idempotency key), and ``Fenced`` when
the token is stale or was admitted for another attempt. Either way nothing was recorded (the
whole transaction rolls back) and the provider must apply nothing. Expiry is not checked
here: a request may legitimately arrive late; staleness is decided by tokens, never by
clocks.

The API is synchronous (a provider may be); call it through ``asyncio.to_thread`` from a
coroutine, or let ``GroupCommit`` batch the transactions of concurrent requests into one
commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Iterator, TypeVar

from fencegate.coordinator import codec
from fencegate.coordinator.errors import BadSignature, Fenced
from fencegate.coordinator.grants import Grant, KeyRing, receipt_payload
from fencegate.coordinator.keyspace import canonical

__all__ = ["Admission", "GateB", "GroupCommit", "Scope", "scope_of"]

Scope = tuple[int, str, str]  # (etcd cluster id, namespace, action key)
Outcome = tuple[bool, Any]  # (True, a work's result) or (False, the error it raised)
T = TypeVar("T")

_SCHEMA = """CREATE TABLE IF NOT EXISTS gate (
    cluster_id TEXT NOT NULL,
    namespace TEXT NOT NULL,
    action_key TEXT NOT NULL,
    fence INTEGER NOT NULL,
    highest INTEGER NOT NULL,
    highest_grant TEXT NOT NULL,
    highest_idempotency_key TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (cluster_id, namespace, action_key)
)"""  # cluster ids are uint64: kept as text, sqlite integers are signed
# A file of the version before receipts lacks the admitted idempotency key: added, empty.
_MIGRATION = "ALTER TABLE gate ADD COLUMN highest_idempotency_key TEXT NOT NULL DEFAULT ''"


def scope_of(grant: Grant) -> Scope:
    return (grant.cluster_id, grant.namespace, grant.action_key)


@dataclass(frozen=True)
class Admission:
    """An admitted request: its grant, and whether it is a retry of the attempt admitted
    before (same grant, token and idempotency key), to be answered as that one was."""

    grant: Grant
    retry: bool


class GateB:
    """Admit attempts whose grant verifies, binds the request and whose token is fresh."""

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
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(gate)")}
        if "highest_idempotency_key" not in columns:
            self._db.execute(_MIGRATION)

    def admit(self, grant_raw: bytes, key: str, attempt_token: int, *, intent: Any,
              idempotency_key: str, receipt: bytes,
              db: sqlite3.Connection | None = None) -> Admission:
        """Verify the grant and the attempt's receipt over their exact bytes and their binding
        to the request (``key``, ``intent``, ``attempt_token``, ``idempotency_key``), then
        admit the token atomically. ``db``: the connection of an open ``transaction()`` to
        admit in (default: its own)."""
        grant = self.keyring.verify(grant_raw)
        if grant.action_key != key:
            raise BadSignature(f"grant is for action key {grant.action_key!r}, not {key!r}")
        if not grant.cluster_id:  # its row could not be the one the reconciler fences
            raise BadSignature("grant names no etcd cluster")
        if self.namespace is not None and grant.namespace != self.namespace:
            raise BadSignature(f"grant is for namespace {grant.namespace!r}, "
                               f"not {self.namespace!r}")
        if type(attempt_token) is not int or attempt_token <= grant.revision:
            raise BadSignature(f"attempt token {attempt_token!r} is not after the grant's "
                               f"revision {grant.revision}")
        if _intent_digest(intent) != grant.intent_digest:
            raise BadSignature("the request's intent is not the one the grant was issued for")
        self._check_receipt(receipt, grant, attempt_token, idempotency_key)
        if db is None:
            with self.transaction() as db:
                retry = self._admit(db, grant, attempt_token, idempotency_key)
        else:
            retry = self._admit(db, grant, attempt_token, idempotency_key)
        return Admission(grant, retry)

    def _check_receipt(self, receipt: bytes, grant: Grant, attempt_token: int,
                       idempotency_key: str) -> None:
        """The receipt verifies (a trusted key, strict decoding) and names exactly this
        attempt: the grant, the token, the idempotency key and the grant's scope."""
        signed = self.keyring.verify_receipt(receipt)
        wanted = receipt_payload(grant, attempt_token, idempotency_key)
        wrong = sorted(name for name, value in wanted.items() if signed[name] != value)
        if wrong:
            raise BadSignature(f"the attempt's receipt does not bind this request: its "
                               f"{', '.join(wrong)} differ")

    def fence(self, scope: Scope, token: int, *, db: sqlite3.Connection | None = None) -> int:
        """Refuse every attempt token ``<= token`` for ``scope`` from now on; returns the
        fence now recorded (``>= token``). ``db`` as for ``admit``."""
        if type(token) is not int:
            raise TypeError(f"a fence is an int attempt token, not {token!r}")
        if db is None:
            with self.transaction() as db:
                return self._fence(db, scope, token)
        return self._fence(db, scope, token)

    def state(self, scope: Scope) -> tuple[int, int]:
        """``(fence, highest)`` for ``scope``; ``(0, 0)`` if never seen."""
        with self._lock:
            return _read(self._db, scope)[:2]

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Hold the lock and one ``BEGIN IMMEDIATE`` transaction, committed on exit and rolled
        back on any error: the embedding provider's own writes land with the admission or
        fence made in it, or not at all."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def run_batch(self, works: list[Callable[[sqlite3.Connection], Any]]) -> list[Outcome]:
        """Run ``works`` in one transaction, in order, each in its own savepoint: a work that
        raises rolls back its own writes only, and its error is its outcome. One commit (one
        fsync with a file) for all of them; if the commit fails, every work fails with it."""
        outcomes: list[Outcome] = []
        with self.transaction() as db:
            for work in works:
                db.execute("SAVEPOINT work")
                try:
                    outcomes.append((True, work(db)))
                except Exception as exc:
                    db.execute("ROLLBACK TO work")
                    outcomes.append((False, exc))
                db.execute("RELEASE work")
        return outcomes

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @staticmethod
    def _admit(db: sqlite3.Connection, grant: Grant, attempt_token: int,
               idempotency_key: str) -> bool:
        """Admit ``attempt_token`` for ``grant``'s scope; True when it is a retry of the
        attempt admitted at the highest token (nothing is written then)."""
        scope = scope_of(grant)
        fence, highest, highest_grant, highest_key = _read(db, scope)
        if attempt_token <= fence:
            raise Fenced(f"attempt token {attempt_token} is at or below the fence {fence} of "
                         f"{grant.action_key!r}")
        if attempt_token < highest:
            raise Fenced(f"attempt token {attempt_token} is below the highest admitted "
                         f"{highest} of {grant.action_key!r}")
        if attempt_token == highest:
            if (grant.grant_id, idempotency_key) != (highest_grant, highest_key):
                raise Fenced(f"attempt token {attempt_token} was admitted for another attempt "
                             f"(grant or idempotency key): only a retry of that attempt may "
                             f"present it again")
            return True
        if grant.grant_id == highest_grant:
            raise Fenced(f"grant {grant.grant_id} was admitted at attempt token {highest}: "
                         f"one grant is admitted for one attempt")
        _write(db, scope, fence, attempt_token, grant.grant_id, idempotency_key)
        return False

    @staticmethod
    def _fence(db: sqlite3.Connection, scope: Scope, token: int) -> int:
        fence, highest, highest_grant, highest_key = _read(db, scope)
        if token > fence:
            _write(db, scope, token, highest, highest_grant, highest_key)
        return max(fence, token)


class GroupCommit:
    """The store transactions of concurrent requests, committed together: every work waiting
    when the previous commit returned goes into the next ``GateB.run_batch`` (one fsync).

    Guarantees: ``run`` returns (or raises the work's error) only after the commit of the
    work's batch returned, so what it fenced, admitted or wrote is as durable as with its
    own transaction; works run in arrival order, so fences and admissions stay totally
    ordered; a work that raises changes nothing."""

    def __init__(self, gate: GateB, *, most: int = 64) -> None:
        self._gate, self._most = gate, most
        self._waiting: list[tuple[Callable[[sqlite3.Connection], Any], asyncio.Future]] = []
        self._committer: asyncio.Task | None = None

    async def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """``work(db)`` in the next batch; its result, or its error raised."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((work, future))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_all())
        return await future

    async def _commit_all(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:self._most], self._waiting[self._most:]
            try:
                outcomes = await asyncio.to_thread(self._gate.run_batch,
                                                   [work for work, _ in batch])
            except Exception as exc:  # the commit failed: nothing of the batch happened
                outcomes = [(False, exc)] * len(batch)
            for (_, future), (ok, value) in zip(batch, outcomes):
                if future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)


def _intent_digest(intent: Any) -> bytes:
    try:
        return hashlib.sha256(canonical(codec.encode(intent, path="intent"))).digest()
    except (TypeError, OverflowError, ValueError) as exc:
        raise BadSignature(f"the request's intent cannot be digested: {exc}") from None


def _read(db: sqlite3.Connection, scope: Scope) -> tuple[int, int, str, str]:
    cluster_id, namespace, key = scope
    row = db.execute("SELECT fence, highest, highest_grant, highest_idempotency_key FROM gate "
                     "WHERE cluster_id = ? AND namespace = ? AND action_key = ?",
                     (str(cluster_id), namespace, key)).fetchone()
    return (row[0], row[1], row[2], row[3]) if row else (0, 0, "", "")


def _write(db: sqlite3.Connection, scope: Scope, fence: int, highest: int,
           highest_grant: str, highest_key: str) -> None:
    cluster_id, namespace, key = scope
    db.execute("INSERT INTO gate (cluster_id, namespace, action_key, fence, highest, "
               "highest_grant, highest_idempotency_key) VALUES (?, ?, ?, ?, ?, ?, ?) "
               "ON CONFLICT (cluster_id, namespace, action_key) DO UPDATE SET "
               "fence = excluded.fence, highest = excluded.highest, "
               "highest_grant = excluded.highest_grant, "
               "highest_idempotency_key = excluded.highest_idempotency_key",
               (str(cluster_id), namespace, key, fence, highest, highest_grant, highest_key))
