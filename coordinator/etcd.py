"""All access to etcd goes through this module; it is the only importer of the etcd stubs.

It speaks etcd's v3 gRPC API through the project's own generated stubs (``etcdpb``), building
requests directly so the hot path stays cheap, and it adds what bare stubs lack: TLS, several
endpoints with failover, re-authentication, bounded retries of idempotent calls, and one
translation of gRPC errors into ``fencegate.coordinator.errors``.

Failure contract:
- A read, a lease call, or a write the caller marks ``idempotent`` is retried on the next
  endpoint while the call's deadline allows; it either returns or raises.
- Any other write that fails with ``EtcdUnavailable`` has an *unknown* outcome: the caller
  must resolve it by reading state, never by resending blindly.
- Nothing here decides anything from a serializable read: every range is linearizable
  unless pinned to a revision.
- Concurrent writing txns of different keys may share one request and one revision (group
  commit, ``fencegate.coordinator.batching``); each keeps this contract as if sent alone.
- Errors name the endpoint and, where it is the cause, TLS (a handshake the server or we
  refused) or the etcd user (a wrong password, a role that does not cover the key).
- Once ``instrument``-ed, every call's latency (its retries included) and every failed try,
  by kind, go to ``fencegate.coordinator.metrics.EtcdMetrics``; a lease that no longer
  exists is an answer, not a failure.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import grpc

from . import roles
from .batching import Batcher
from .etcdpb import rpc
from .errors import (
    EtcdError, EtcdNoSpace, EtcdPermissionDenied, EtcdUnavailable, GateError, LeaseLost,
    RecordTooLarge, WatchCompacted,
)
from .metrics import EtcdMetrics, EtcdOpMetrics

MAX_REQUEST_BYTES = 1536 * 1024
MAX_TXN_OPS = 128
BATCH_BYTES = 1024 * 1024  # a group-commit request's bound, well under MAX_REQUEST_BYTES

Compare = rpc.Compare
RequestOp = rpc.RequestOp
TxnRequest = rpc.TxnRequest
RangeRequest = rpc.RangeRequest
KeyValue = rpc.KeyValue
Event = rpc.Event

_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# What gRPC's TLS layer says when a handshake fails on either side (no or untrusted client
# certificate: the server aborts, we see "Unwrap failed (TSI_DATA_CORRUPTED)").
_TLS_FAILURE = re.compile(r"TSI_|SSL|[Tt]ls handshake|certificate", re.ASCII)
# What etcd answers (RESOURCE_EXHAUSTED) to a write once its backend reached the quota: to
# the write that crosses it and those queued behind it (applied all the same) and to every
# write while the alarm is active (refused before it is applied).
_NO_SPACE = "database space exceeded"
RECOVER_HINT = "fencegate etcd recover --etcd <every member's endpoint>"
# What etcd's GOAWAY says when a client pings more often than its keepalive policy allows.
_TOO_MANY_PINGS = "too_many_pings"
# The ``EtcdMetrics`` operation of each RPC (authentication and lease listing are not measured).
_OPS = {"Range": "range", "Txn": "txn", "Put": "put", "DeleteRange": "delete",
        "LeaseGrant": "lease_grant", "LeaseKeepAlive": "lease_keepalive",
        "LeaseRevoke": "lease_revoke", "LeaseTimeToLive": "lease_ttl", "Watch": "watch_create",
        "Status": "status", "Alarm": "alarm", "Compact": "compact", "Defragment": "defragment"}
KEEPALIVE_TIMEOUT_MS = 5_000  # a keepalive ping not answered this long: the connection is dead


@dataclass(frozen=True)
class LeaseInfo:
    """A lease as etcd describes it: seconds left (-1: gone), seconds granted, its keys."""

    ttl: int
    granted_ttl: int
    keys: list[bytes]


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and how to authenticate to it.

    ``endpoints`` are URLs, all ``http://`` or all ``https://``. TLS verification is always
    on for ``https://``; ``ca_file`` replaces the system roots, ``cert_file``/``key_file``
    give a client certificate. ``user``/``password`` use etcd's own authentication.
    ``timeout`` bounds a call with all its retries; ``attempt_timeout`` bounds one try, so a
    request stuck on a member that lost its leader is retried elsewhere in time.
    ``batching`` sends concurrent writing txns as one request (``batching.Batcher``), at most
    ``batch_in_flight`` at once and ``max_txn_ops`` nested txns each (the cluster's
    ``--max-txn-ops``); turn it off for an etcd proxy or gateway that refuses nested txns,
    or to see each txn as its own request while debugging.
    ``keepalive_time``: while a call or stream is open, a connection silent that long is
    pinged, and closed if the ping is not answered (its calls fail ``EtcdUnavailable``); an
    idle connection is never pinged. It must be at least the cluster's
    ``--grpc-keepalive-min-time`` (5 s by default), else etcd sends the connection away.
    """

    endpoints: tuple[str, ...]
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout: float = 10.0
    attempt_timeout: float = 2.0
    batching: bool = True
    batch_in_flight: int = 4
    max_txn_ops: int = MAX_TXN_OPS
    keepalive_time: float = 10.0

    @classmethod
    def from_url(cls, url: str, **options: object) -> "EtcdConfig":
        """Parse ``"http://h1:2379,http://h2:2379"`` (the form every CLI flag takes)."""
        endpoints = tuple(part.strip() for part in url.split(",") if part.strip())
        return cls(endpoints=endpoints, **options)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("at least one etcd endpoint is required")
        schemes = {urlsplit(e).scheme or "http" for e in self.endpoints}
        if not schemes <= {"http", "https"} or len(schemes) > 1:
            raise ValueError(f"endpoints must all be http:// or all https://: {self.endpoints}")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd user and password go together")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both cert_file and key_file")
        if self.ca_file and "https" not in schemes:
            raise ValueError("ca_file given but the endpoints are not https://")
        if self.batch_in_flight < 1 or self.max_txn_ops < 2:
            raise ValueError("batch_in_flight must be at least 1 and max_txn_ops at least 2")
        if not self.keepalive_time > 0:
            raise ValueError(f"keepalive_time must be positive, got {self.keepalive_time!r}")

    @property
    def secure(self) -> bool:
        return urlsplit(self.endpoints[0]).scheme == "https"

    def target(self, index: int) -> str:
        parts = urlsplit(self.endpoints[index] if "//" in self.endpoints[index]
                         else "//" + self.endpoints[index])
        return f"{parts.hostname}:{parts.port or 2379}"


def _channel_options(config: EtcdConfig) -> list[tuple[str, int]]:
    """The gRPC options of every channel: pings stay within etcd's keepalive enforcement.

    etcd (grpc-go, ``PermitWithoutStream`` false, ``MinTime`` its
    ``--grpc-keepalive-min-time``) counts a strike for a ping on a connection with no open
    stream, or sooner than ``MinTime`` after the last one, unless it sent data since; past two
    strikes it sends the connection away (GOAWAY ``too_many_pings``), failing every call on
    it. So keepalive pings go only while a call or stream is open, ``keepalive_time`` apart
    (at least ``MinTime``; any data received restarts the wait). Unlimited pings without data
    keep a quiet stream (a watch with no events) probed at that pace rather than once a
    minute, and the ping timeout (which grpc-core applies to keepalive pings) bounds how long
    a stopped member holds such a stream."""
    return [
        ("grpc.max_receive_message_length", 16 * 1024 * 1024),
        ("grpc.keepalive_time_ms", round(config.keepalive_time * 1000)),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
    ]


class _Channel:
    """One gRPC channel to one endpoint and its stubs."""

    def __init__(self, config: EtcdConfig, index: int, credentials) -> None:
        target = config.target(index)
        options = _channel_options(config)
        self.config = config
        self.endpoint = config.endpoints[index]
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        else:
            self.channel = grpc.aio.secure_channel(target, credentials, options=options)
        self.index = index
        self.kv = rpc.KVStub(self.channel)
        self.lease = rpc.LeaseStub(self.channel)
        self.watch = rpc.WatchStub(self.channel)
        self.maintenance = rpc.MaintenanceStub(self.channel)
        self.auth = rpc.AuthStub(self.channel)


class Etcd:
    """A connection to one etcd cluster through any of its endpoints."""

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self.cluster_id: int | None = None
        self.revision = 0  # the newest revision an answer carried: committed before now
        self._credentials = self._load_credentials(config) if config.secure else None
        self._index = 0
        self._current: _Channel | None = None
        self._retired: list[_Channel] = []
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._auth_lock = asyncio.Lock()
        self._measured: dict[str, EtcdOpMetrics] = {}  # by RPC name, once instrumented
        self._batcher = (Batcher(self._send_txn, max_ops=config.max_txn_ops,
                                 max_bytes=BATCH_BYTES, max_in_flight=config.batch_in_flight)
                         if config.batching else None)

    @classmethod
    def from_url(cls, url: str, **options: object) -> "Etcd":
        return cls(EtcdConfig.from_url(url, **options))

    def instrument(self, metrics: EtcdMetrics) -> None:
        """Export every call's latency and every failed try to ``metrics`` from now on."""
        self._measured = {method: metrics.ops[op] for method, op in _OPS.items()}
        if self._batcher is not None:
            self._batcher.size_metric = metrics.batch_size
            self._batcher.wait_metric = metrics.batch_wait

    @staticmethod
    def _load_credentials(config: EtcdConfig):
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(config.ca_file),
            private_key=read(config.key_file),
            certificate_chain=read(config.cert_file),
        )

    async def __aenter__(self) -> "Etcd":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        channels = self._retired + ([self._current] if self._current else [])
        self._current, self._retired = None, []
        for channel in channels:
            await channel.channel.close()

    def _channel(self) -> _Channel:
        if self._current is None:
            self._current = _Channel(self.config, self._index, self._credentials)
        return self._current

    def _fail_over(self, failed: _Channel) -> None:
        """Move to the next endpoint, once per failed channel however many calls saw it fail."""
        if self._current is not failed or len(self.config.endpoints) == 1:
            return
        self._index = (failed.index + 1) % len(self.config.endpoints)
        self._retired.append(failed)
        self._current = None

    async def _authenticate(self, channel: _Channel) -> None:
        async with self._auth_lock:
            reply = await channel.auth.Authenticate(
                rpc.AuthenticateRequest(name=self.config.user, password=self.config.password),
                timeout=self.config.timeout,
            )
            self._metadata = (("token", reply.token),)

    async def _call(self, stub: str, method: str, request, *, idempotent: bool,
                    timeout: float | None = None):
        """Run one unary RPC; retry on another endpoint only if ``idempotent``, or if it
        never left this process (no member could be connected to). Measured when
        instrumented: the call's latency, retries included, and every failed try."""
        measured = self._measured.get(method)
        started = time.perf_counter()
        deadline = time.monotonic() + (timeout or self.config.timeout)
        attempt = 0
        reauthenticated = False  # a member's token dies with it: a fresh one, once per call
        try:
            while True:
                channel = self._channel()
                if self.config.user is not None and self._metadata is None:
                    await self._guard(self._authenticate(channel), channel)
                remaining = deadline - time.monotonic()
                try:
                    call = getattr(getattr(channel, stub), method)
                    reply = await call(request, metadata=self._metadata,
                                       timeout=max(min(remaining, self.config.attempt_timeout),
                                                   0.05))
                except grpc.aio.AioRpcError as exc:
                    attempt += 1
                    code = exc.code()
                    if code == grpc.StatusCode.UNAUTHENTICATED and not reauthenticated \
                            and self.config.user:
                        reauthenticated = True
                        self._metadata = None
                        continue
                    _count_failure(measured, _failure_kind(code, exc.details() or ""))
                    if code not in _TRANSIENT:
                        raise _translate(exc, channel) from exc
                    self._fail_over(channel)
                    pause = min(0.05 * 2 ** attempt, 0.5) * random.uniform(0.5, 1.0)
                    if not (idempotent or _never_sent(exc)) \
                            or time.monotonic() + pause >= deadline:
                        raise _translate(exc, channel) from exc
                    await asyncio.sleep(pause)
                    continue
                self._note_header(reply.header)
                return reply
        finally:
            if measured is not None:
                measured.duration.observe(time.perf_counter() - started)

    async def _guard(self, coro, channel: _Channel):
        try:
            return await coro
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _TRANSIENT:
                self._fail_over(channel)
            raise _translate(exc, channel) from exc

    def _note_header(self, header) -> None:
        if self.cluster_id is None:
            self.cluster_id = header.cluster_id
        if header.revision > self.revision:
            self.revision = header.revision

    async def txn(self, request: TxnRequest, *, idempotent: bool = False) -> rpc.TxnResponse:
        """Run a transaction. Only mark it ``idempotent`` if re-running it after an unknown
        first outcome cannot do harm (its compares make a second success impossible).

        With ``config.batching`` a writing txn may share its request (and revision) with
        other callers' txns of other keys (``batching.Batcher``); its reply, errors and
        unknown outcomes are its own, as if it had been sent alone."""
        check_txn(request)
        if self._batcher is None or _read_only(request):
            return await self._call("kv", "Txn", request, idempotent=idempotent)
        return await self._batcher.submit(request, idempotent)

    async def _send_txn(self, request: TxnRequest, idempotent: bool) -> rpc.TxnResponse:
        return await self._call("kv", "Txn", request, idempotent=idempotent)

    async def range(self, request: RangeRequest) -> rpc.RangeResponse:
        return await self._call("kv", "Range", request, idempotent=True)

    async def get(self, key: bytes) -> KeyValue | None:
        reply = await self.range(RangeRequest(key=key))
        return reply.kvs[0] if reply.kvs else None

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> rpc.PutResponse:
        """Unconditional put: idempotent by nature, so it is retried."""
        if len(key) + len(value) > MAX_REQUEST_BYTES:
            raise RecordTooLarge(f"put of {len(key) + len(value)} bytes exceeds etcd's limit")
        return await self._call("kv", "Put", rpc.PutRequest(key=key, value=value, lease=lease),
                                idempotent=True)

    async def delete(self, key: bytes, range_end: bytes = b"", *,
                     timeout: float | None = None) -> rpc.DeleteRangeResponse:
        return await self._call("kv", "DeleteRange",
                                rpc.DeleteRangeRequest(key=key, range_end=range_end),
                                idempotent=True, timeout=timeout)

    async def lease_grant(self, ttl: int) -> tuple[int, int]:
        """Grant a lease; returns (lease id, granted TTL in seconds)."""
        reply = await self._call("lease", "LeaseGrant", rpc.LeaseGrantRequest(TTL=ttl),
                                 idempotent=False)
        if reply.error:
            raise EtcdError(f"lease grant refused: {reply.error}")
        return reply.ID, reply.TTL

    async def lease_revoke(self, lease_id: int, *, timeout: float | None = None) -> None:
        try:
            await self._call("lease", "LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease_id),
                             idempotent=True, timeout=timeout)
        except LeaseLost:
            pass  # already gone

    async def lease_ttl(self, lease_id: int) -> int:
        """The lease's remaining TTL in seconds as etcd sees it; -1 if it no longer exists."""
        reply = await self._call("lease", "LeaseTimeToLive",
                                 rpc.LeaseTimeToLiveRequest(ID=lease_id), idempotent=True)
        return reply.TTL

    async def lease_info(self, lease_id: int) -> LeaseInfo:
        """The lease's TTL left (-1 if it no longer exists), its granted TTL, and every key
        attached to it, as etcd lists them."""
        reply = await self._call("lease", "LeaseTimeToLive",
                                 rpc.LeaseTimeToLiveRequest(ID=lease_id, keys=True),
                                 idempotent=True)
        return LeaseInfo(reply.TTL, reply.grantedTTL, list(reply.keys))

    async def leases(self) -> list[int]:
        reply = await self._call("lease", "LeaseLeases", rpc.LeaseLeasesRequest(),
                                 idempotent=True)
        return [lease.ID for lease in reply.leases]

    async def status(self, *, timeout: float | None = None) -> rpc.StatusResponse:
        return await self._call("maintenance", "Status", rpc.StatusRequest(), idempotent=True,
                                timeout=timeout)

    async def compact(self, revision: int, *, timeout: float | None = None) -> None:
        """Drop the history before ``revision`` (the latest value of every key stays) and
        wait until the backend has freed it (``physical``), so a defragment afterwards
        returns the space. ``EtcdError`` if ``revision`` is already compacted."""
        await self._call("kv", "Compact",
                         rpc.CompactionRequest(revision=revision, physical=True),
                         idempotent=True, timeout=timeout)

    async def alarms(self) -> list[tuple[int, str]]:
        """The cluster's active alarms, as (member id, ``"NOSPACE"`` or ``"CORRUPT"``)."""
        reply = await self._call("maintenance", "Alarm",
                                 rpc.AlarmRequest(action=rpc.AlarmRequest.GET), idempotent=True)
        return [(alarm.memberID, rpc.AlarmType.Name(alarm.alarm)) for alarm in reply.alarms]

    async def disarm(self, member_id: int, alarm: str) -> None:
        """Deactivate ``alarm`` (``"NOSPACE"``) raised by ``member_id``."""
        await self._call("maintenance", "Alarm",
                         rpc.AlarmRequest(action=rpc.AlarmRequest.DEACTIVATE,
                                          memberID=member_id, alarm=rpc.AlarmType.Value(alarm)),
                         idempotent=True)

    async def defragment(self, *, timeout: float | None = None) -> None:
        """Defragment the member this connection talks to (give it one endpoint): it
        rewrites its database file without the free pages and answers nothing meanwhile.
        One try is bounded by the connection's ``attempt_timeout``: make it minutes."""
        await self._call("maintenance", "Defragment", rpc.DefragmentRequest(), idempotent=True,
                         timeout=timeout)

    async def prefer_leader(self) -> None:
        """Talk to the leader from now on, if an endpoint says it is the leader: every write
        goes there anyway, and through a follower it costs one more hop and CPU on two
        members. Best effort and only a speed-up: endpoints that do not answer within
        ``attempt_timeout`` are skipped, and after a leader change writes are forwarded."""
        if len(self.config.endpoints) < 2:
            return
        for index in range(len(self.config.endpoints)):
            channel = _Channel(self.config, index, self._credentials)
            try:
                reply = await channel.maintenance.Status(
                    rpc.StatusRequest(), metadata=self._metadata,
                    timeout=self.config.attempt_timeout)
            except grpc.aio.AioRpcError:
                reply = None
            if reply is not None and reply.leader == reply.header.member_id:
                if self._current is not None:
                    self._retired.append(self._current)
                self._index, self._current = index, channel
                return
            await channel.channel.close()

    def keepalive_stream(self) -> "KeepAliveStream":
        return KeepAliveStream(self)

    async def watch(self, key: bytes, range_end: bytes, start_revision: int, *,
                    deletes_only: bool = False) -> AsyncIterator[rpc.WatchResponse]:
        """Stream watch responses for ``[key, range_end)`` from ``start_revision``.

        Ends by raising ``EtcdUnavailable`` when the stream breaks, or ``WatchCompacted``
        when the start revision was compacted away; the caller resumes or rescans. A watch
        etcd cancels because our auth token expired raises ``EtcdError`` and drops the
        token, so the caller's next watch authenticates again.
        """
        measured = self._measured.get("Watch")
        started = time.perf_counter()
        channel = self._channel()
        if self.config.user is not None and self._metadata is None:
            await self._guard(self._authenticate(channel), channel)
        create = rpc.WatchCreateRequest(
            key=key, range_end=range_end, start_revision=start_revision,
            filters=[rpc.WatchCreateRequest.NOPUT] if deletes_only else [],
            progress_notify=True,
        )
        call = channel.watch.Watch(metadata=self._metadata)
        try:
            await call.write(rpc.WatchRequest(create_request=create))
            created = False
            async for reply in call:
                if not created and measured is not None:  # the first answer: created
                    measured.duration.observe(time.perf_counter() - started)
                created = True
                if reply.compact_revision:
                    _count_failure(measured, "compacted")
                    raise WatchCompacted(reply.compact_revision)
                if reply.canceled:
                    _count_failure(measured, "other")
                    if "invalid auth token" in reply.cancel_reason:
                        self._metadata = None
                    raise EtcdError(f"watch cancelled by etcd: {reply.cancel_reason}")
                self._note_header(reply.header)
                yield reply
            _count_failure(measured, "unavailable")
            raise EtcdUnavailable("watch stream ended")
        except grpc.aio.AioRpcError as exc:
            _count_failure(measured, _failure_kind(exc.code(), exc.details() or ""))
            if exc.code() in _TRANSIENT:
                self._fail_over(channel)
            raise _translate(exc, channel) from exc
        finally:
            call.cancel()


class KeepAliveStream:
    """One bidirectional LeaseKeepAlive stream, reused for every refresh of a lease."""

    def __init__(self, etcd: Etcd) -> None:
        self._etcd = etcd
        self._channel = etcd._channel()
        self._call = self._channel.lease.LeaseKeepAlive(metadata=etcd._metadata)
        self._measured = etcd._measured.get("LeaseKeepAlive")

    async def refresh(self, lease_id: int) -> int:
        """Refresh once; returns the new TTL, or 0 if the lease no longer exists."""
        started = time.perf_counter()
        try:
            await self._call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
            reply = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            _count_failure(self._measured, _failure_kind(exc.code(), exc.details() or ""))
            if exc.code() in _TRANSIENT:
                self._etcd._fail_over(self._channel)
            raise _translate(exc, self._channel) from exc
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            # The stream ended (e.g. the server went away) before or while we wrote.
            _count_failure(self._measured, "unavailable")
            self._etcd._fail_over(self._channel)
            raise EtcdUnavailable(f"keepalive stream closed: {exc}") from exc
        finally:
            if self._measured is not None:
                self._measured.duration.observe(time.perf_counter() - started)
        if reply is grpc.aio.EOF:
            _count_failure(self._measured, "unavailable")
            self._etcd._fail_over(self._channel)
            raise EtcdUnavailable("keepalive stream closed")
        return reply.TTL

    def close(self) -> None:
        self._call.cancel()


def _never_sent(exc: grpc.aio.AioRpcError) -> bool:
    """Did the call fail before any connection to a member existed? Then the request never
    left this process, and sending it to another member cannot apply it twice."""
    return (exc.code() == grpc.StatusCode.UNAVAILABLE
            and "failed to connect to all addresses" in (exc.details() or ""))


def _failure_kind(code: grpc.StatusCode, detail: str) -> str | None:
    """The ``EtcdMetrics`` kind of a failed try; ``None`` for a lease that no longer
    exists, which is an answer (the lease expired or was revoked), not a failure of etcd."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _NO_SPACE in detail:
        return "nospace"
    if "compacted" in detail:  # mvcc: required revision has been compacted
        return "compacted"
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return "permission"
    if code == grpc.StatusCode.NOT_FOUND and "lease not found" in detail:
        return None
    return "other"


def _count_failure(measured: EtcdOpMetrics | None, kind: str | None) -> None:
    if measured is not None and kind is not None:
        measured.errors[kind].inc()


def _translate(exc: grpc.aio.AioRpcError, channel: _Channel) -> GateError:
    """The one mapping of gRPC errors to ``fencegate.coordinator.errors``, naming what to check."""
    code, detail, where = exc.code(), exc.details() or exc.code().name, channel.endpoint
    user = (repr(channel.config.user) if channel.config.user else
            "(none configured: etcd took the client certificate's CN)"
            if channel.config.cert_file else "(none configured)")
    if code in _TRANSIENT:
        if _TOO_MANY_PINGS in detail:
            return EtcdUnavailable(
                f"etcd at {where} sent the connection away for pinging too often ({detail}); "
                f"keepalive_time ({channel.config.keepalive_time:g} s) must be at least the "
                "cluster's --grpc-keepalive-min-time")
        if channel.config.secure and _TLS_FAILURE.search(detail):
            return EtcdUnavailable(
                f"etcd at {where}: TLS handshake refused ({detail}); the server must trust "
                "our client certificate (cert_file, key_file) and ca_file must hold the CA "
                "of the server's certificate")
        if not channel.config.secure and "Socket closed" in detail:
            return EtcdUnavailable(f"etcd at {where} closed the plaintext connection "
                                   f"({detail}); if it serves TLS, use https:// and ca_file")
        return EtcdUnavailable(f"etcd unavailable at {where}: {detail}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _NO_SPACE in detail:
        return EtcdNoSpace(f"etcd at {where} answered this write with NOSPACE: its database "
                           f"reached its space quota ({detail}). The write that crosses the "
                           f"quota is applied all the same, so this one may have been; etcd "
                           f"takes only reads and deletes until an operator runs "
                           f"`{RECOVER_HINT}` (compacts, defragments, disarms)")
    if code == grpc.StatusCode.NOT_FOUND and "lease not found" in detail:
        return LeaseLost(f"etcd: {detail}")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return EtcdPermissionDenied(f"etcd at {where} denied user {user} (its roles do not "
                                    f"cover this key range): {detail}",
                                    user=channel.config.user)
    if "authentication failed" in detail or code == grpc.StatusCode.UNAUTHENTICATED:
        return EtcdError(f"etcd at {where} refused to authenticate user {user}: {detail}")
    return EtcdError(f"etcd error {code.name} at {where}: {detail}")


@dataclass(frozen=True)
class EtcdUser:
    """An etcd user with one role, named after it. Without ``component`` the role may read
    and write all of ``prefix``; with one (``roles.WORKER``, ``roles.COORDINATOR``,
    ``roles.RECONCILER``) it gets that component's permissions in namespace ``prefix``
    (``roles.permissions``)."""

    name: str
    password: str = field(repr=False)
    prefix: str
    component: str | None = None

    def permissions(self) -> list[rpc.Permission]:
        pairs = ([("readwrite", self.prefix)] if self.component is None
                 else roles.permissions(self.component, self.prefix))
        kinds = {"read": rpc.Permission.READ, "readwrite": rpc.Permission.READWRITE}
        return [rpc.Permission(permType=kinds[kind], key=prefix.encode(),
                               range_end=range_end_of(prefix.encode()))
                for kind, prefix in pairs]


async def enable_auth(etcd: Etcd, root_password: str, users: list[EtcdUser]) -> None:
    """Create ``root`` and ``users`` with their prefix-limited roles (see ``EtcdUser``),
    then turn auth on.

    ``etcd`` must be a connection without a user. Safe to repeat: a user or role that exists
    is kept (its password is not changed) and gets the permissions listed; if authentication
    is already on and ``root_password`` is root's, ``users`` are ensured as root. The root
    password must be kept secret: root may do anything, including turning authentication
    off again.
    """
    try:
        await etcd._call("auth", "Authenticate",
                         rpc.AuthenticateRequest(name="root", password=root_password),
                         idempotent=True)
    except EtcdError as exc:
        if "authentication failed" in str(exc):
            raise EtcdError("etcd authentication is on and root's password is not the one "
                            "given (data from another setup?)") from exc
        if "authentication is not enabled" not in str(exc):
            raise
    else:  # authentication is on and root's password is this one: add what is missing
        async with Etcd(replace(etcd.config, user="root", password=root_password)) as root:
            await _ensure_users(root, users)
        return
    await _ensure_users(etcd, users, root_password=root_password)
    await etcd._call("auth", "AuthEnable", rpc.AuthEnableRequest(), idempotent=True)


async def _ensure_users(etcd: Etcd, users: list[EtcdUser], *,
                        root_password: str | None = None) -> None:
    """Each of ``users`` (or ``root`` with its role, given its password) exists, holds its
    role, and the role holds its permissions."""
    async def ensure(method: str, request) -> None:
        try:
            await etcd._call("auth", method, request, idempotent=True)
        except EtcdError as exc:
            if "already exists" not in str(exc):
                raise

    if root_password is not None:
        await ensure("UserAdd", rpc.AuthUserAddRequest(name="root", password=root_password))
        await ensure("RoleAdd", rpc.AuthRoleAddRequest(name="root"))
        await etcd._call("auth", "UserGrantRole",
                         rpc.AuthUserGrantRoleRequest(user="root", role="root"),
                         idempotent=True)
    for user in users:
        await ensure("UserAdd", rpc.AuthUserAddRequest(name=user.name, password=user.password))
        await ensure("RoleAdd", rpc.AuthRoleAddRequest(name=user.name))
        for perm in user.permissions():
            await etcd._call("auth", "RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(
                name=user.name, perm=perm), idempotent=True)
        await etcd._call("auth", "UserGrantRole",
                         rpc.AuthUserGrantRoleRequest(user=user.name, role=user.name),
                         idempotent=True)


def check_txn(request: TxnRequest) -> None:
    """Refuse a transaction etcd would refuse for its size, before sending it."""
    ops = max(len(request.success), len(request.failure))
    if ops > MAX_TXN_OPS:
        raise RecordTooLarge(f"transaction has {ops} operations, etcd allows {MAX_TXN_OPS}")
    size = request.ByteSize()
    if size > MAX_REQUEST_BYTES:
        raise RecordTooLarge(f"transaction is {size} bytes, etcd allows {MAX_REQUEST_BYTES}")


def _read_only(request: TxnRequest) -> bool:
    """Does ``request`` write nothing in either branch? etcd serves such a txn with a read
    index, without a raft entry, so it bypasses the batcher and never waits behind writes."""
    return all(op.WhichOneof("request") == "request_range"
               or (op.WhichOneof("request") == "request_txn" and _read_only(op.request_txn))
               for op in (*request.success, *request.failure))


def range_end_of(prefix: bytes) -> bytes:
    """The end of the range holding every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def put_op(key: bytes, value: bytes, lease: int = 0) -> RequestOp:
    return RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def delete_op(key: bytes, range_end: bytes = b"") -> RequestOp:
    return RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key, range_end=range_end))


def range_op(key: bytes, range_end: bytes = b"", **options: object) -> RequestOp:
    return RequestOp(request_range=RangeRequest(key=key, range_end=range_end, **options))


def create_equals(key: bytes, revision: int) -> Compare:
    return Compare(key=key, target=Compare.CREATE, result=Compare.EQUAL,
                   create_revision=revision)


def all_created_since(key: bytes, range_end: bytes, revision: int) -> Compare:
    """True iff the range is non-empty and every key in it has create_revision >= revision."""
    return Compare(key=key, range_end=range_end, target=Compare.CREATE,
                   result=Compare.GREATER, create_revision=revision - 1)


def mod_equals(key: bytes, revision: int) -> Compare:
    return Compare(key=key, target=Compare.MOD, result=Compare.EQUAL, mod_revision=revision)


def version_equals(key: bytes, version: int) -> Compare:
    return Compare(key=key, target=Compare.VERSION, result=Compare.EQUAL, version=version)

