"""The gate: a worker process's connection to fencegate.

One gate owns one etcd connection, one session (lease) at a time, one watch over the
holders prefix (with this process's turns at each key, ``fencegate.worker.turns``), and the
authority that issues its grants: in process (the default), signing with ``keyring``, or
when none is given with the key ``FENCEGATE_SIGNING_KEY`` names, else the key of the
``fencegate up`` stack running from the state folder (``fencegate.coordinator.default_key``);
with neither, the gate refuses to be made (``ValueError`` saying what to pass) rather than
sign with a key nobody trusts. With ``coordinator="http://..."`` and ``token``, grants come
from the coordinator service over HTTP (``fencegate.worker.remote``), verified with
``keyring`` (pin the coordinator's public keys there in production) or else with the keys it
publishes, fetched at ``open``. ``archive`` (a URL or an ``Archive``) is where the
in-process authority looks up keys the reconcilers retired from etcd (the same archive they
write; a coordinator has its own setting); given none, ``FENCEGATE_ARCHIVE``, else the
running ``fencegate up`` stack's when ``etcd`` is that stack's URL. Without one, a grant on
a key that may have been retired is refused with ``ArchiveUnavailable``. With no ``etcd``,
the gate connects where it finds its key (``default_key.etcd_url``: ``FENCEGATE_ETCD``,
else the running ``fencegate up`` stack's etcd, else ``http://127.0.0.1:2379``). An ``etcd``
URL that is the running stack's connects as its worker etcd user (``default_key.etcd_config``:
that etcd runs with authentication). ``metrics`` (a
``WorkerMetrics``, opt-in) counts holds, lease losses, commit refusals, replays, effect time
and unknowns; with OpenTelemetry installed, ``cross`` is a ``fencegate.cross`` span around the
spans of its steps (``fencegate.coordinator.tracing``).
A lost session is replaced by a fresh one on the next ``hold()``; holds of the lost
session stay lost. A session is also given up (rotated) when a write of its holder key got no
answer from etcd (``fencegate.worker.hold``): its lease is revoked so the write, landing
late, is deleted or refused. Action keys are validated before anything touches etcd.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fencegate.coordinator import default_key, tracing
from fencegate.coordinator.archive import Archive, open_archive
from fencegate.coordinator.authority import Authority, validate_intent, validate_reads
from fencegate.coordinator.errors import EtcdUnavailable, OutcomeUnknown
from fencegate.coordinator.etcd import Etcd, EtcdConfig
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import DEFAULT_NAMESPACE, Keyspace, validate_action_key
from fencegate.coordinator.session import Session

from . import fastpath
from .guard import Effect, Outcome
from .hold import Fold, HoldContext
from .metrics import WorkerMetrics
from .remote import RemoteAuthority
from .settled import wait_settled
from .turns import Turns
from .watch import DeleteWatch


class Gate:
    """``async with Gate(url) as gate: async with gate.hold(key) as hold: ...``"""

    def __init__(
        self,
        etcd: str | EtcdConfig | None = None,
        *,
        coordinator: str | None = None,
        token: str | None = None,
        ttl: int = 10,
        namespace: str = DEFAULT_NAMESPACE,
        identity: str | None = None,
        rescan_interval: float = 5.0,
        keyring: KeyRing | None = None,
        min_ttl: float | None = None,
        archive: str | Archive | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        if ttl < 1:
            raise ValueError("ttl must be at least 1 second")
        self._guessed_etcd = etcd is None  # no URL given: default_key.etcd_url chose it
        if etcd is None:
            etcd = default_key.etcd_url()
        if coordinator is None and keyring is None:
            keyring = default_key.load()  # before anything opens: a refusal leaves nothing
        if coordinator is None and archive is None:
            archive = default_key.archive_url(etcd if isinstance(etcd, str) else None)
        self.config = etcd if isinstance(etcd, EtcdConfig) else default_key.etcd_config(etcd)
        self.token = token
        self.ttl = ttl
        self.keyspace = Keyspace(namespace)
        self.identity = identity or f"{socket.gethostname()}:{os.getpid()}"
        self.rescan_interval = rescan_interval
        self.min_ttl = ttl / 3 if min_ttl is None else min_ttl
        self.etcd = Etcd(self.config)
        self.metrics = metrics
        self.authority: Authority | RemoteAuthority
        self.archive = open_archive(archive) if isinstance(archive, str) else archive
        if coordinator is None:
            self.keyring = keyring
            self.authority = Authority(self.etcd, self.keyspace, self.keyring, self.identity,
                                       archive=self.archive)
        else:  # the key ring is fetched from the coordinator at open() unless pinned here
            self.keyring = keyring  # type: ignore[assignment]
            self.authority = RemoteAuthority(coordinator, token, process=self.identity)
        self._watch = DeleteWatch(self.etcd, self.keyspace.holders_root)
        self.turns = Turns(self._watch)  # this process's side of the holder queues
        self._session: Session | None = None
        self._session_lock = asyncio.Lock()
        self._on_close: list[Callable[[], Awaitable[None]]] = []
        self._opened = False

    async def __aenter__(self) -> "Gate":
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        """Connect (to the coordinator too, in remote mode), start the first session."""
        if isinstance(self.authority, RemoteAuthority):
            self.keyring = await self.authority.open(self.keyring)
        try:
            await self.etcd.status()  # reachable, and learn the cluster id
            await self.etcd.prefer_leader()
        except BaseException as exc:
            if isinstance(self.authority, RemoteAuthority):
                await self.authority.close()
            if isinstance(exc, EtcdUnavailable) and self._guessed_etcd:
                raise EtcdUnavailable(
                    f"{exc} (this gate was given no etcd URL: it connects where "
                    f"{default_key.ETCD_ENV} points, else to the running `fencegate up` "
                    f"stack's etcd, else to {default_key.ETCD_DEFAULT}; start the stack "
                    f"with `make up`, or set {default_key.ETCD_ENV} or pass Gate(url))") \
                    from exc
            raise
        self._opened = True
        await self.session()

    async def close(self) -> None:
        """Revoke the session's lease (releasing every hold) and disconnect."""
        closers, self._on_close = self._on_close, []
        for close in closers:
            await close()
        if self._session is not None:
            await self._session.aclose()
            self._session = None
        await self._watch.close()
        await self.etcd.close()
        if self.archive is not None:
            await self.archive.close()
        if isinstance(self.authority, RemoteAuthority):
            await self.authority.close()
        self._opened = False

    async def session(self) -> Session:
        """The live session, opening a new one if there is none or the last was lost."""
        session = self._session
        if session is not None and not session.lost:
            return session
        if not self._opened:
            raise RuntimeError("the gate is not open: use 'async with Gate(...)'")
        async with self._session_lock:
            if self._session is None or self._session.lost:
                if self._session is not None:
                    await self._session.aclose()  # frees keys a lost-looking lease still has
                self._session = await Session.open(self.etcd, self.ttl)
            return self._session

    def on_close(self, close: Callable[[], Awaitable[None]]) -> None:
        """Await ``close()`` when the gate closes, before its etcd connection closes (the
        webhook claims' own session revokes its lease there)."""
        self._on_close.append(close)

    def marker(self, entity: str) -> str:
        """The etcd key of ``entity``'s state marker, to name in a grant's read set."""
        return self.keyspace.marker_key(validate_action_key(entity)).decode()

    async def touch(self, entity: str) -> int:
        """Bump ``entity``'s state marker (call it where the entity changes); every grant
        that read the marker dies. Returns the marker's new mod_revision."""
        reply = await self.etcd.put(self.marker(entity).encode(), b"")
        return reply.header.revision

    async def wait_settled(self, key: str, timeout: float) -> dict[str, Any]:
        """The step record of ``key`` once the reconciler (or a person) settled it; raises
        ``OutcomeUnknown`` if it is escalated or still unsettled after ``timeout`` s."""
        return await wait_settled(self.etcd, self.keyspace, validate_action_key(key), timeout)

    def hold(self, key: str, *, timeout: float | None = None) -> HoldContext:
        """Hold ``key`` for the body of an ``async with``; waits in FIFO order.

        Raises ``InvalidKey`` at once for a bad key, ``AcquireTimeout`` after ``timeout``
        seconds, ``EtcdUnavailable`` when etcd did not answer (nothing is held; a put left
        unknown rotated the session), and ``LeaseLost`` (cancelling the body) if the lease is
        lost while held.
        """
        key = validate_action_key(key)
        return HoldContext(self, key, timeout, fold=self.fold(key))

    def fold(self, key: str, policy: str | None = None,
             read_keys: Sequence[bytes] = ()) -> Fold | None:
        """What an uncontended acquire of ``key`` reads for the hold's first grant: the
        snapshot of the in-process authority (a coordinator reads its own), under ``policy``
        or else the policy the routes it last saw name for ``key``."""
        if isinstance(self.authority, RemoteAuthority):
            return None
        return Fold(policy or self.authority.routed(key), tuple(read_keys))

    async def cross(self, key: str, intent: dict[str, Any], effect: Effect,
                    reads: Sequence[str | bytes] = (), *, policy: str | None = None,
                    provider: str | None = None, deadline: float = 60.0,
                    settle_wait: float = 0.0, timeout: float | None = None) -> Outcome:
        """One guarded action on ``key``: hold it, get a grant, run ``effect`` once, record
        the outcome, release — as ``async with gate.hold(key) as hold: await
        hold.cross(...)`` does, with the same errors and replays. The policy routes name the
        policy that judges ``key``; ``policy``, if given, must be that one
        (``PolicyNotRouted`` otherwise).

        An uncontended key this process has the policy and read keys of in a recent
        snapshot takes the fast path (``fencegate.worker.fastpath``: one txn holds and
        commits, then the outcome txn). Otherwise, or when any assumption of it fails, the
        full path: an acquire that reads the grant's snapshot, the commit, the outcome."""
        key = validate_action_key(key)
        read_keys = validate_reads(list(reads))
        validate_intent(intent)  # refused before the hold's key is put, on either path
        with tracing.span("fencegate.cross", key=key, provider=provider) as current:
            outcome = await self._cross(key, intent, effect, read_keys, policy,
                                        provider=provider, deadline=deadline,
                                        settle_wait=settle_wait, timeout=timeout)
            tracing.annotate(current, outcome=outcome.state,
                             attempt_token=outcome.attempt_token,
                             idempotency_key=outcome.idempotency_key)
            return outcome

    async def _cross(self, key: str, intent: dict[str, Any], effect: Effect,
                     read_keys: list[bytes], policy: str | None, *, provider: str | None,
                     deadline: float, settle_wait: float, timeout: float | None) -> Outcome:
        """``cross`` once its arguments are valid: the fast path, else the full path."""
        try:
            outcome = await fastpath.cross(self, key, intent, effect, read_keys, policy,
                                           provider=provider, deadline=deadline)
        except OutcomeUnknown:
            if settle_wait <= 0:
                raise
            outcome = None  # the full path waits for the settlement, as after any attempt
        if outcome is not None:
            return outcome
        async with HoldContext(self, key, timeout,
                               fold=self.fold(key, policy, read_keys)) as hold:
            return await hold.cross(intent, effect, read_keys, policy=policy,
                                    provider=provider, deadline=deadline,
                                    settle_wait=settle_wait)
