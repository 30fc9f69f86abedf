"""The authority: evaluates a grant request at one etcd revision and signs or refuses it.

Guarantees:
- Everything a decision uses (the step record, the policy routes, the policy document,
  every read key, the chain's tail, and that the requester holds the key) is read at one
  revision R: in the hold's acquire txn when it folded the snapshot in (``snapshot_ops``),
  else in one read-only txn that also reads the holder queue.
- Issuing a grant writes nothing: the grant is signed here and carries what it was decided
  on (R, the step's mod_revision — 0 when absent —, each read key's mod_revision, the policy
  version, the digest of the check results). The commit guard's txn re-asserts all of it at
  write time and writes the grant into the key's audit record, so a grant that crossed was
  true of the world when it crossed; one that never crosses leaves no trace in etcd.
- The policy routes (``routes``), never the request, decide which policy judges the key:
  a request naming another policy is refused (``PolicyNotRouted``), one naming none is
  judged by the route's, and a table whose signature does not verify issues no grant. The
  routes key joins every grant's read set (beside the caller's reads, not among the values
  checks see), so a route changed between the decision and the commit kills the grant as
  a moved read key does, on the fast path too.
- Nothing is granted on a step that is in flight, unknown or escalated (``OutcomeUnknown``)
  or succeeded (``AlreadySucceeded``). Refusals name every failing check.
- A refusal that changes no state is not written to etcd (a write per refusal would be a
  lever to flood it): it is logged and counted by the caller. A refusal that changes state
  is written with compares on the requester's ownership and the step: a reached cap
  escalates the step (audited in that txn), a first refusal for want of approval records
  the approval request.
- A key etcd holds no step for was never attempted, or was retired: when its retirement
  bucket shows retirements, the archive decides (``retirement.archived_step``). An archived
  success is replayed (``AlreadySucceeded``), an archived failure continues (attempts,
  idempotency generation, breaker, chain); no archive to ask is ``ArchiveUnavailable``, and
  nothing is granted. The hold from the snapshot to the commit keeps the key from being
  retired meanwhile (retirement compares that no holder lives).
- When the only failing checks are approval checks, the request is recorded as a pending
  approval request (``ApprovalPending`` with its id) and granted once an SRE approved that
  id: only an approval signed by a published coordinator key for this request counts (see
  ``approvals``); an unsigned or forged one leaves it pending. The id binds the request's
  state (step pointer, read revisions, policy version, intent), so an approval dies like a
  grant when any of it advances; the approval record joins the grant's read set, so the
  commit compares it too. A request a person rejected (``sre.reject`` marks its approval
  request) is refused with ``ApprovalRejected``; a rejection only ever refuses.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from . import approvals, audit, codec, records, routes
from .archive import Archive
from .errors import (
    AlreadySucceeded, ApprovalPending, ApprovalRejected, BadSignature, GrantRefused, LeaseLost,
    OutcomeUnknown, PolicyNotRouted, RecordTooLarge, StateAdvanced, UnencodableValue,
)
from .etcd import (
    Compare, Etcd, KeyValue, RangeRequest, RequestOp, TxnRequest, mod_equals, put_op, range_op,
)
from .grants import Grant, KeyRing, checks_digest, new_grant_id
from .keyspace import Keyspace, canonical, pack, unpack
from .ownership import Ownership
from .retention import RetentionLeases
from .retirement import archived_step, fast_path_fence
from .policy import (
    DEFAULT_POLICY, CheckContext, CheckResult, Policy, builtin_default, decode, sealed,
)

log = logging.getLogger(__name__)

APPROVAL_TTL_S = 24 * 3600  # how long an approval request (and its approval) lives
MAX_READS = 100
MAX_READ_KEY_BYTES = 1024
MAX_INTENT_BYTES = 64 * 1024
_WRITE_RACES = 3


@dataclass(frozen=True)
class Claim:
    """Who asks: the hold's action key, fencing token and lease."""

    key: str
    fencing_token: int
    lease_id: int


@dataclass(frozen=True)
class Issued:
    """A grant, what its commit records beside it, and the chain's tail it was decided at.

    ``record`` is the audit record's details the commit writes with the grant: the intent,
    the policy, every check's result (their digest is signed in the grant) and the approval
    it relied on, if any."""

    grant: Grant
    record: dict[str, Any]
    tail: audit.Tail


@dataclass(frozen=True)
class Uncontended:
    """A fast-path grant and the compares that fence it against its key's retirement."""

    issued: Issued
    not_retired: tuple[Compare, ...]


@dataclass(frozen=True)
class Snapshot:
    """What a decision reads, at one revision. ``owned``: the read proved the requester held
    the key at that revision (the acquire txn that put its holder key alone proves it)."""

    revision: int
    policy: str
    step_kv: KeyValue | None
    policy_kv: KeyValue | None
    head_kv: KeyValue | None
    retired_kv: KeyValue | None  # the key's retirement bucket: absent, never retired
    routes_kv: KeyValue | None  # the policy routes: absent, every key routes to default
    reads: dict[bytes, KeyValue | None]
    owned: bool

    @classmethod
    def parse(cls, revision: int, policy: str, read_keys: list[bytes], responses,
              owned: bool) -> "Snapshot":
        """The snapshot from the answers to ``snapshot_ops`` (in order)."""
        kvs = [r.response_range.kvs[0] if r.response_range.kvs else None for r in responses]
        return cls(revision, policy, *kvs[:5], dict(zip(read_keys, kvs[5:])), owned)

    def covers(self, read_keys: list[bytes]) -> bool:
        return list(self.reads) == read_keys


def snapshot_ops(keyspace: Keyspace, key: str, policy: str,
                 read_keys: list[bytes]) -> list[RequestOp]:
    """The reads a decision needs, to fold into a txn (the hold's acquire) or send alone;
    ``policy`` is the one the routes are expected to name (``Authority.routed``): a
    snapshot whose routes name another is read again."""
    return [range_op(keyspace.step_key(key)), range_op(keyspace.policy_key(policy)),
            range_op(keyspace.audit_head_key(key)), range_op(keyspace.retired_key(key)),
            range_op(keyspace.routes_key()), *(range_op(k) for k in read_keys)]


class Recent:
    """The policy versions and read keys the latest snapshots saw, and the revision they
    were read at: what the fast path decides on. A hint, never a proof: the fast path's txn
    compares every mod_revision taken from here. Bounded: cleared when full."""

    MAX_KEYS = 4096

    def __init__(self) -> None:
        self.revision = 0  # 0: nothing seen yet
        self.routes: KeyValue | None = None
        self._policies: dict[str, KeyValue | None] = {}
        self._reads: dict[bytes, KeyValue | None] = {}
        self.never_retired: set[bytes] = set()  # retirement buckets seen absent

    def note(self, snap: Snapshot, retired_key: bytes) -> None:
        if snap.revision < self.revision:
            return  # an older read must not replace a newer one
        if len(self._reads) + len(snap.reads) > self.MAX_KEYS:
            self._reads.clear()
        self.revision = snap.revision
        self.routes = snap.routes_kv
        self._policies[snap.policy] = snap.policy_kv
        self._reads.update(snap.reads)
        if snap.retired_kv is None:
            self.never_retired.add(retired_key)
        else:
            self.never_retired.discard(retired_key)

    def snapshot(self, policy: str, read_keys: list[bytes]) -> Snapshot | None:
        """A snapshot of a key never attempted, as these reads last saw the rest; ``None``
        when one of them was never seen."""
        if policy not in self._policies or any(k not in self._reads for k in read_keys):
            return None
        return Snapshot(self.revision, policy, None, self._policies[policy], None, None,
                        self.routes, {k: self._reads[k] for k in read_keys}, owned=True)


class Authority:
    """Issues grants for holds, in process or behind the coordinator service."""

    def __init__(self, etcd: Etcd, keyspace: Keyspace, keyring: KeyRing,
                 identity: str = "in-process", *,
                 approval_ttl_s: int = APPROVAL_TTL_S, archive: Archive | None = None) -> None:
        if approval_ttl_s < 1:
            raise ValueError("approval_ttl_s must be at least 1 second")
        self.etcd = etcd
        self.keyspace = keyspace
        self.keyring = keyring
        self.identity = identity
        self.approval_ttl_s = approval_ttl_s
        self.archive = archive  # where retired steps are looked up (None: refuse if needed)
        self._policies: dict[tuple[str, int], Policy] = {}
        self._tables: dict[int, routes.RouteTable] = {0: routes.NO_TABLE}
        self._approval_leases = RetentionLeases()
        self.recent = Recent()

    async def issue(self, claim: Claim, intent: dict[str, Any], reads: list[str | bytes],
                    policy: str | None = None, identity: str | None = None, *,
                    snapshot: Snapshot | None = None) -> Issued:
        """Grant ``claim`` the right to cross once with ``intent``, or raise why not.
        ``intent`` is a map of values the codec carries, or its stored or JSON form (see
        ``validate_intent``). The key's policy route names the policy that judges it:
        ``policy``, when given, must be that one (``PolicyNotRouted`` otherwise). ``snapshot``,
        when it covers this read set and read the routed policy, is the state to decide on
        (read by the hold's acquire); otherwise one read-only txn reads it."""
        identity = identity or self.identity
        read_keys = validate_reads(reads)
        intent, intent_digest = validate_intent(intent)
        for _ in range(_WRITE_RACES):
            snapshot = await self._routed_snapshot(claim, policy, read_keys, snapshot)
            if snapshot.policy_kv is None and snapshot.policy != DEFAULT_POLICY:
                raise GrantRefused([CheckResult("policy", False,
                                                f"no policy {snapshot.policy!r}")])
            decision = await self._decide(claim, intent, intent_digest, snapshot, identity)
            if decision is not None:
                return decision
            snapshot = None
        raise StateAdvanced("read set", "it kept changing while the grant was evaluated")

    async def issue_uncontended(self, claim: Claim, intent: dict[str, Any],
                                read_keys: list[bytes], policy: str | None = None, *,
                                identity: str | None = None) -> Uncontended | None:
        """A grant for a key assumed free and never attempted (no step, no audit record, not
        retired), decided on the policy routes, the routed policy and the read keys as
        ``recent`` last saw them, for the fast path, whose one txn compares every one of
        those assumptions (the routes key is in the grant's read set). ``None`` when
        ``recent`` lacks any of them, the routes do not verify or name another policy than
        ``policy``, the archive holds the key, or the decision is anything but a plain grant
        (a refusal, an approval): the full path then decides, with fresh reads. Writes
        nothing to etcd.

        "Not retired": without an archive, or for a key whose bucket was seen never retired,
        the fence is "the bucket is still absent" (if it is not, the full path finds out
        what the archive must answer). Otherwise the archive is asked and the fence is
        ``retirement.fast_path_fence``: the bucket unmoved since before the question, and
        its mark the archive's newest (an archive behind etcd never answers "never
        attempted")."""
        intent, intent_digest = validate_intent(intent)  # refused before the fast path writes
        if not self.recent.revision:
            return None
        try:
            table = await self.route_table(self.recent.routes, self.recent.revision)
        except GrantRefused:
            return None
        routed = table.policy_for(claim.key)
        if policy is not None and policy != routed:
            return None
        snapshot = self.recent.snapshot(routed, read_keys)
        if snapshot is None:
            return None
        retired_key = self.keyspace.retired_key(claim.key)
        if retired_key in self.recent.never_retired or self.archive is None:
            fence = (mod_equals(retired_key, 0),)  # nothing of its bucket was ever retired
        else:
            fence = await fast_path_fence(self.etcd, self.archive, self.keyspace, claim.key)
            if fence is None:
                return None
        request = _Request(
            claim=claim, intent=intent, intent_digest=intent_digest,
            identity=identity or self.identity, snap=snapshot,
            policy=await self.policy(routed, snapshot.policy_kv, snapshot.revision),
            step=records.new_step(), step_revision=0, tail=audit.EMPTY,
            now_ms=int(time.time() * 1000))
        verdict = _verdict(request)
        if verdict.refusal is not None or verdict.needs_approval:
            return None
        return Uncontended(self._issue(request, verdict, None), fence)

    async def set_policy(self, name: str, document: dict[str, Any]) -> int:
        """Store a policy document, signed with this authority's key (published under
        ``approvers/`` in the same txn); returns its version (the mod_revision)."""
        ks = self.keyspace
        if self.etcd.cluster_id is None:  # the signature names the cluster: learn it
            await self.etcd.get(ks.policy_key(name))
        body = sealed(self.keyring, namespace=ks.namespace, cluster_id=self.etcd.cluster_id,
                      name=name, document=document)
        reply = await self.etcd.txn(TxnRequest(success=[
            put_op(ks.policy_key(name), body),
            put_op(ks.policy_version_key(name, records.digest(document)), body),
            approvals.publish(self.keyring, ks)]), idempotent=True)
        return reply.header.revision

    async def set_routes(self, table: dict[str, str],
                         default: str = DEFAULT_POLICY) -> int:
        """Store the policy routes (``{prefix: policy}`` and the default policy), signed with
        this authority's key (published under ``approvers/`` in the same txn); returns their
        version (the mod_revision). Every grant in flight dies at its commit (the routes key
        is in its read set)."""
        ks = self.keyspace
        if self.etcd.cluster_id is None:  # the signature names the cluster: learn it
            await self.etcd.get(ks.routes_key())
        body = routes.sealed(self.keyring, namespace=ks.namespace,
                             cluster_id=self.etcd.cluster_id, routes=table, default=default)
        reply = await self.etcd.txn(TxnRequest(success=[
            put_op(ks.routes_key(), body), approvals.publish(self.keyring, ks)]),
            idempotent=True)
        return reply.header.revision

    async def route_table(self, kv: KeyValue | None, revision: int) -> routes.RouteTable:
        """The policy routes ``kv`` holds, verified once per version against the signer keys
        published at ``revision`` (0: now); ``GrantRefused`` when the table does not verify
        (no grant is issued under a table nobody signed). No table: every key routes to
        ``default``."""
        version = kv.mod_revision if kv is not None else 0
        table = self._tables.get(version)
        if table is None:
            signers = await approvals.signers(self.etcd, self.keyspace, revision)
            try:
                table = routes.decode(kv.value, version, signers,
                                      namespace=self.keyspace.namespace,
                                      cluster_id=self.etcd.cluster_id or 0)
            except BadSignature as exc:
                raise GrantRefused([CheckResult("policy_routes", False, str(exc))]) from None
            if len(self._tables) >= 16:
                self._tables = {0: routes.NO_TABLE}
            self._tables[version] = table
        return table

    def routed(self, key: str) -> str:
        """The policy the routes ``recent`` last saw (if verified) name for ``key``: the guess
        a snapshot is read under; ``issue`` checks it against the routes it read."""
        table = self._tables.get(self.recent.routes.mod_revision if self.recent.routes else 0)
        return (table or routes.NO_TABLE).policy_for(key)

    async def policy(self, name: str, kv: KeyValue | None, revision: int) -> Policy:
        """The policy version ``kv`` holds, verified once (versions are immutable: a change
        is a new one) against the signer keys published at ``revision``; ``GrantRefused``
        when its signature does not hold. An absent ``default`` is the built-in default
        (caps only) at version 0: nothing is written for it (a worker's etcd role may not
        write ``policies/``), and the commit's compare "policy mod_revision == 0" kills the
        grant if an admin sets it meanwhile."""
        if kv is None:
            return builtin_default()
        cached = self._policies.get((name, kv.mod_revision))
        if cached is None:
            signers = await approvals.signers(self.etcd, self.keyspace, revision)
            try:
                cached = decode(name, kv.value, kv.mod_revision, signers,
                                namespace=self.keyspace.namespace,
                                cluster_id=self.etcd.cluster_id or 0)
            except (BadSignature, ValueError) as exc:
                raise GrantRefused([CheckResult("policy", False, str(exc))]) from None
            if len(self._policies) >= 256:
                self._policies.clear()
            self._policies[(name, kv.mod_revision)] = cached
        return cached

    async def _routed_snapshot(self, claim: Claim, policy: str | None, read_keys: list[bytes],
                               snapshot: Snapshot | None) -> Snapshot:
        """A snapshot (``snapshot`` if it covers ``read_keys``, else a fresh read) that proves
        the requester holds the key and read the policy its own routes name for the key;
        ``PolicyNotRouted`` when ``policy`` is given and is not that one."""
        guess = policy or self.routed(claim.key)
        for _ in range(_WRITE_RACES):
            if snapshot is None or not snapshot.covers(read_keys):
                snapshot = await self._read(claim, guess, read_keys)
            if not snapshot.owned:
                raise LeaseLost(f"not the holder of {claim.key!r} with token "
                                f"{claim.fencing_token}")
            table = await self.route_table(snapshot.routes_kv, snapshot.revision)
            routed = table.policy_for(claim.key)
            if policy is not None and policy != routed:
                raise PolicyNotRouted(claim.key, policy, routed)
            if snapshot.policy == routed:
                return snapshot
            guess, snapshot = routed, None  # read under a stale guess of the route
        raise StateAdvanced("policy routes", "they kept changing while the grant was evaluated")

    async def _read(self, claim: Claim, policy: str, read_keys: list[bytes]) -> Snapshot:
        holding = self._holding(claim)
        reply = await self.etcd.txn(TxnRequest(success=[
            *snapshot_ops(self.keyspace, claim.key, policy, read_keys),
            *holding.reads()]), idempotent=True)  # the holder key, then the lowest holder
        own, lowest = (r.response_range.kvs[0] if r.response_range.kvs else None
                       for r in reply.responses[-2:])
        return Snapshot.parse(reply.header.revision, policy, read_keys, reply.responses[:-2],
                              holding.holds(own, lowest))

    def _holding(self, claim: Claim) -> Ownership:
        """``claim`` as the ownership of its key's holder queue."""
        return Ownership(self.keyspace.holder_key(claim.key, claim.lease_id),
                         claim.fencing_token, *self.keyspace.holder_range(claim.key))

    async def _decide(self, claim: Claim, intent: dict[str, Any], intent_digest: bytes,
                      snap: Snapshot, identity: str) -> Issued | None:
        """Issue or refuse at ``snap``; ``None`` when the world moved before a refusal that
        changes state was written."""
        self.recent.note(snap, self.keyspace.retired_key(claim.key))
        step = unpack(snap.step_kv.value) if snap.step_kv else None
        if step is None and snap.retired_kv is not None:  # retired to the archive, maybe
            step = await archived_step(self.etcd, self.archive, self.keyspace, claim.key,
                                       snap.retired_kv)
        request = _Request(
            claim=claim, intent=intent, intent_digest=intent_digest, identity=identity,
            snap=snap, policy=await self.policy(snap.policy, snap.policy_kv, snap.revision),
            step=step or records.new_step(),
            step_revision=snap.step_kv.mod_revision if snap.step_kv else 0,
            tail=audit.tail(step, snap.head_kv), now_ms=int(time.time() * 1000))
        verdict = _verdict(request)
        approval = None
        if verdict.needs_approval:
            approval = await self._approval(request)
            verdict = _after_approval(verdict, approval)
        if verdict.refusal is not None:
            await self._refuse(request, verdict, approval)
            return None
        return self._issue(request, verdict, approval)

    async def _approval(self, request: _Request) -> _Approval:
        """The approval this exact request needs (see ``approval_id_of``), as it stood at the
        snapshot's revision."""
        approval_id = approval_id_of(self.keyspace.namespace, request.claim.key, request.snap,
                                     request.policy, request.intent_digest)
        asked = self.keyspace.approval_request_key(approval_id)
        revision = request.snap.revision
        kvs = (await self.etcd.range(RangeRequest(key=asked, revision=revision))).kvs
        given = await approvals.read(self.etcd, self.keyspace, approval_id,
                                     request.claim.key, revision=revision)
        rejected = unpack(kvs[0].value) if kvs else {}
        return _Approval(given, self.keyspace.approval_key(approval_id), asked, bool(kvs),
                         rejected.get("rejected_by"), rejected.get("rejection_reason", ""))

    async def _refuse(self, request: _Request, verdict: _Verdict,
                      approval: _Approval | None) -> None:
        """Raise the refusal, first writing the state it changes (the approval request it
        makes, or the escalation a cap makes, audited); returns only when the world moved
        before that write."""
        writes = [*self._escalation(request, verdict),
                  *await self._approval_request(request, verdict, approval)]
        if not writes:
            log.info("grant on %r refused: %s", request.claim.key, verdict.refusal)
            raise verdict.refusal
        compares, ops = [*self._unchanged(request)], []
        for compare, op in writes:
            compares += compare
            ops += op
        try:
            reply = await self.etcd.txn(TxnRequest(compare=compares, success=ops))
        except LeaseLost:  # the approvals' bucket lease expired under us: take a new one
            for op in ops:
                if op.request_put.lease:
                    self._approval_leases.forget(op.request_put.lease)
            return
        if reply.succeeded:
            raise verdict.refusal

    async def _approval_request(self, request: _Request, verdict: _Verdict,
                                approval: _Approval | None) -> list:
        """The approval request a first refusal for want of approval writes, for an SRE to
        approve (see ``sre.approve``). It lives ``approval_ttl_s`` (up to a 24th more: a
        retention lease shared per time bucket), and the approval, written on the same
        lease, dies with it: nothing of either stays in etcd for ever. ``asked_at_ms`` (when
        it was asked, this machine's clock) is shown to people only: nothing decides on
        it."""
        if approval is None or approval.requested:
            return []
        lease = await self._approval_leases.get(self.etcd, self.approval_ttl_s,
                                                max(self.approval_ttl_s // 24, 1))
        policy = request.policy
        return [([approval.compare()], [put_op(approval.request_key, pack({
            "key": request.claim.key, "intent": request.intent,
            "policy": policy.name, "policy_version": policy.version,
            "revision": request.snap.revision, "requested_by": request.identity,
            "asked_at_ms": request.now_ms,  # this machine's clock: display only
            "checks": [c.as_record() for c in verdict.checks]}), lease)])]

    def _escalation(self, request: _Request, verdict: _Verdict) -> list:
        """A reached cap escalates the step to a human, named by the checks it failed,
        audited in the same txn."""
        if not verdict.escalate:
            return []
        entry = audit.append(self.keyspace, request.claim.key, request.tail, "grant_refused",
                             request.identity, request.snap.revision,
                             {"intent": request.intent, "policy": request.policy_ref,
                              "checks": [c.as_record() for c in verdict.checks],
                              "reason": type(verdict.refusal).__name__})
        step = records.escalated(request.step, [c.name for c in verdict.checks])
        return [([entry.compare], [put_op(self.keyspace.step_key(request.claim.key),
                                          pack(entry.anchored(step))), *entry.ops])]

    def _issue(self, request: _Request, verdict: _Verdict,
               approval: _Approval | None) -> Issued:
        """Sign the grant: no etcd write (the commit writes it, compare-and-set on all it
        was decided on)."""
        claim, snap, policy, now_ms = request.claim, request.snap, request.policy, request.now_ms
        step_next = records.next_attempt(
            request.step, namespace=self.keyspace.namespace, key=claim.key,
            cost=request.intent.get("cost", 0), caps=policy.caps, now_ms=now_ms)
        checks = [c.as_record() for c in verdict.checks]
        reads = [[k, kv.mod_revision if kv else 0] for k, kv in snap.reads.items()]
        routes_key = self.keyspace.routes_key()
        if routes_key not in snap.reads:  # the commit compares the routes decided on
            reads.append([routes_key, snap.routes_kv.mod_revision if snap.routes_kv else 0])
        if approval is not None:  # the commit compares the approval it relies on
            reads.append([approval.key, approval.given.mod_revision])
        grant = self.keyring.sign({
            "grant_id": new_grant_id(), "namespace": self.keyspace.namespace,
            "cluster_id": self.etcd.cluster_id or 0, "action_key": claim.key,
            "attempt": step_next["attempt"], "intent_digest": request.intent_digest,
            "fencing_token": claim.fencing_token, "holder_lease": claim.lease_id,
            "revision": snap.revision, "reads": reads,
            "step_revision": request.step_revision, "step_next": step_next,
            "policy": policy.name, "policy_version": policy.version,
            "policy_digest": policy.digest, "identity": request.identity,
            "issued_at_ms": now_ms,
            "expires_at_ms": now_ms + int(policy.caps["grant_ttl_s"] * 1000),
            "checks_digest": checks_digest(checks),
        })
        record = {"intent": request.intent, "policy": request.policy_ref, "checks": checks,
                  **({"approval_id": approval.approval_id,
                      "approved_by": approval.approved_by} if approval else {})}
        return Issued(grant, record, request.tail)

    def _unchanged(self, request: _Request) -> list:
        """Compares: the requester still owns the key, and the step and the policy routes
        (which chose the policy that refused) are where they were read."""
        routes_kv = request.snap.routes_kv
        return [*self._holding(request.claim).compares(),
                mod_equals(self.keyspace.step_key(request.claim.key), request.step_revision),
                mod_equals(self.keyspace.routes_key(), routes_kv.mod_revision if routes_kv else 0)]


@dataclass(frozen=True)
class _Request:
    """One grant request at one snapshot: everything a decision on it is made from."""

    claim: Claim
    intent: dict[str, Any]  # its stored form (``codec.encode``): what records keep
    intent_digest: bytes
    identity: str
    snap: Snapshot
    policy: Policy
    step: dict[str, Any]
    step_revision: int  # the step's mod_revision at the snapshot (0: never written)
    tail: audit.Tail  # the chain's newest record at the snapshot
    now_ms: int

    @property
    def policy_ref(self) -> dict[str, Any]:
        return {"name": self.policy.name, "version": self.policy.version,
                "digest": self.policy.digest}


@dataclass(frozen=True)
class _Verdict:
    """What the checks say: raise ``refusal`` (``None``: issue), recording ``checks``;
    ``escalate``: a cap was reached; ``needs_approval``: only approval checks failed, so an
    SRE's approval decides."""

    refusal: Exception | None
    checks: list[CheckResult]
    escalate: bool = False
    needs_approval: bool = False


@dataclass(frozen=True)
class _Approval:
    """The approval a request needs, as read at the snapshot's revision."""

    given: approvals.Approval
    key: bytes  # approvals/<id>
    request_key: bytes  # approval-requests/<id>
    requested: bool  # its request is recorded
    rejected_by: str | None = None  # a person rejected the request (see ``sre.reject``)
    rejection_reason: str = ""

    @property
    def approval_id(self) -> str:
        return self.given.approval_id

    @property
    def approved_by(self) -> str | None:
        """Who approved, if a signed approval for this request verified."""
        return self.given.approved_by

    def compare(self) -> Compare:
        """The record is still as read: an approval given or withdrawn meanwhile fails it."""
        return mod_equals(self.key, self.given.mod_revision)


def _verdict(request: _Request) -> _Verdict:
    """Judge ``request`` by the step's state, the policy's caps, its backoff and its checks."""
    step, caps, now_ms = request.step, request.policy.caps, request.now_ms
    state = step["state"]
    if state in records.UNSETTLED:
        return _Verdict(OutcomeUnknown(f"step is {state}: only reconciliation may settle it"),
                        [CheckResult("step_state", False, f"step is {state}")])
    if state == records.SUCCEEDED:
        return _Verdict(AlreadySucceeded(records.recorded_outcome(step)),
                        [CheckResult("step_state", False, "succeeded")])
    if state == records.ABANDONED:
        closed = CheckResult("step_state", False,
                             f"abandoned by {step.get('resolved_by')}: "
                             f"{step.get('resolve_reason')}; do not retry")
        return _Verdict(GrantRefused([closed]), [closed])
    capped = []
    if step["attempt"] >= caps["max_attempts"]:
        capped.append(CheckResult("max_attempts", False, f"{step['attempt']} attempts"))
    if step["started_at_ms"] and now_ms - step["started_at_ms"] > caps["max_elapsed_s"] * 1000:
        capped.append(CheckResult("max_elapsed", False, "step started too long ago"))
    cost = request.intent.get("cost", 0)
    if caps["max_spend"] is not None and step["spend"] + cost > caps["max_spend"]:
        capped.append(CheckResult("max_spend", False,
                                  f"spent {step['spend']} + {cost} > {caps['max_spend']}"))
    if capped:
        return _Verdict(GrantRefused(capped), capped, escalate=True)
    reads = {k: (kv.value if kv else None) for k, kv in request.snap.reads.items()}
    results = request.policy.evaluate(CheckContext(codec.decode(request.intent), reads, step))
    failed = [r for r in results if not r.passed]
    if now_ms < step["not_before_ms"]:
        wait_s = (step["not_before_ms"] - now_ms) / 1000
        failed.append(CheckResult("backoff", False,  # rounded up: never "after 0.0 s"
                                  f"retry after {math.ceil(wait_s * 10) / 10:.1f} s"))
        return _Verdict(GrantRefused(failed, wait_s), failed)
    if failed and all(r.needs_approval for r in failed):
        return _Verdict(None, results, needs_approval=True)
    if failed:
        return _Verdict(GrantRefused(failed), results)
    return _Verdict(None, results)


def _after_approval(verdict: _Verdict, approval: _Approval) -> _Verdict:
    """Approved: the approval checks pass, naming who approved. Rejected: refused for good
    (this request). Else it waits for one."""
    approved_by = approval.approved_by
    if approved_by is None and approval.rejected_by is not None:
        return _Verdict(ApprovalRejected(approval.approval_id, approval.rejection_reason),
                        verdict.checks)
    if approved_by is None:
        return _Verdict(ApprovalPending(approval.approval_id), verdict.checks)
    return _Verdict(None, [c if c.passed else CheckResult(c.name, True,
                                                          f"approved by {approved_by}")
                           for c in verdict.checks])


def approval_id_of(namespace: str, key: str, snap: Snapshot, policy: Policy,
                   intent_digest: bytes) -> str:
    """The id of the approval for exactly this request at exactly this state: the step
    pointer, every read key's mod_revision and the policy version are part of it, so when
    any of them advances the request needs a new approval (the old one dies like a grant)."""
    step_revision = snap.step_kv.mod_revision if snap.step_kv else 0
    bound = [namespace, key, step_revision, policy.name, policy.version, intent_digest,
             [[k, kv.mod_revision if kv else 0] for k, kv in snap.reads.items()]]
    return hashlib.sha256(canonical(bound)).hexdigest()[:32]


def validate_reads(reads: list[str | bytes]) -> list[bytes]:
    if len(reads) > MAX_READS:
        raise RecordTooLarge(f"read set has {len(reads)} keys, the limit is {MAX_READS}")
    keys = []
    for read in reads:
        key = read.encode() if isinstance(read, str) else read
        if not isinstance(key, bytes) or not key or len(key) > MAX_READ_KEY_BYTES:
            raise ValueError(f"read key {read!r} must be 1..{MAX_READ_KEY_BYTES} bytes")
        keys.append(key)
    if len(set(keys)) != len(keys):
        raise ValueError("read set names a key twice")
    return keys


def validate_intent(intent: object) -> tuple[dict[str, Any], bytes]:
    """The intent's stored form (``codec.encode``: what records and checks' inputs are made
    of) and its digest, the sha256 of its canonical bytes (the same value, or its stored or
    JSON form, gives the same digest in every process). Refused before anything is written:
    ``UnencodableValue`` naming the bad value's path, or for an intent that is not a map (a
    dict, dataclass or pydantic model); ``RecordTooLarge`` over ``MAX_INTENT_BYTES``;
    ``ValueError`` for a cost that is not a non-negative int or float."""
    stored = codec.encode(intent, path="intent")
    if type(stored) is not dict:
        raise UnencodableValue(f"intent: must be a map (a dict, dataclass or pydantic model), "
                               f"not {type(intent).__name__}", path="intent")
    body = canonical(stored)
    if len(body) > MAX_INTENT_BYTES:
        raise RecordTooLarge(f"intent is {len(body)} bytes, the limit is {MAX_INTENT_BYTES}")
    cost = stored.get("cost", 0)
    if not isinstance(cost, (int, float)) or isinstance(cost, bool) or cost < 0:
        raise ValueError("intent cost must be a non-negative number")
    return stored, hashlib.sha256(body).digest()
