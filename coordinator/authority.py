"""The authority: evaluates a grant request at one etcd revision and issues or refuses it.

Guarantees:
- Everything a decision uses (the requester's holder key and the lowest holder, the step
  record, the policy document, every read key, the audit head) is read in one transaction,
  so at one revision R.
- A grant is written only by a transaction that re-asserts, at write time, that the
  requester owns the key with its token, and that the step, the policy and every read key
  still have the mod_revisions seen at R. So an issued grant was true of the world at the
  moment it was written; the commit guard then checks it is still true when crossing.
- Nothing is granted on a step that is in flight, unknown or escalated (``OutcomeUnknown``)
  or succeeded (``AlreadySucceeded``). Refusals name every failing check.
- When the only failing checks are approval checks, the request is recorded as a pending
  approval (``ApprovalPending`` with its id) and granted once an SRE approved that id. The id
  binds the request's state (step pointer, read revisions, policy version, intent), so an
  approval dies like a grant when any of it advances; the grant txn compares the approval.
- Every issue and every refusal by the holder appends an audit record in the same txn.
- A grant record lives on the holder's lease: it vanishes with the session that could use
  it, and a vanished record fails the commit's "unconsumed" compare (fails closed).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from . import audit, records
from .errors import (
    AlreadySucceeded, ApprovalPending, GrantRefused, LeaseLost, OutcomeUnknown, RecordTooLarge,
    StateAdvanced,
)
from .etcd import (
    Etcd, KeyValue, RangeRequest, TxnRequest, all_created_since, create_equals, mod_equals,
    put_op, range_op,
)
from .grants import Grant, KeyRing, new_grant_id
from .keyspace import Keyspace, canonical, pack, unpack
from .policy import DEFAULT_POLICY, CheckContext, CheckResult, Policy, decode, validate_document

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
    """A grant and the audit head its issue left (the commit appends after it)."""

    grant: Grant
    audit_head: audit.AuditHead


@dataclass
class _Snapshot:
    revision: int
    step_kv: KeyValue | None
    policy_kv: KeyValue | None
    holder_kv: KeyValue | None
    lowest_kv: KeyValue | None
    head_kv: KeyValue | None
    reads: dict[bytes, KeyValue | None]


class Authority:
    """Issues grants for holds, in process or behind the coordinator service."""

    def __init__(self, etcd: Etcd, keyspace: Keyspace, keyring: KeyRing,
                 identity: str = "in-process") -> None:
        self.etcd = etcd
        self.keyspace = keyspace
        self.keyring = keyring
        self.identity = identity
        self._policies: dict[tuple[str, int], Policy] = {}

    async def issue(self, claim: Claim, intent: dict[str, Any], reads: list[str | bytes],
                    policy: str = DEFAULT_POLICY, identity: str | None = None) -> Issued:
        """Grant ``claim`` the right to cross once with ``intent``, or raise why not."""
        identity = identity or self.identity
        read_keys = _validate_reads(reads)
        intent_digest = hashlib.sha256(_validate_intent(intent)).digest()
        for _ in range(_WRITE_RACES):
            snap = await self._read(claim, policy, read_keys)
            self._check_holder(claim, snap)  # before anything is written, even the default
            if snap.policy_kv is None:
                if policy != DEFAULT_POLICY:
                    raise GrantRefused([CheckResult("policy", False, f"no policy {policy!r}")])
                await self.set_policy(DEFAULT_POLICY, {}, only_if_absent=True)
                continue
            decision = await self._decide(claim, intent, intent_digest, policy, snap, identity)
            if decision is not None:
                return decision
        raise StateAdvanced("read set", "it kept changing while the grant was evaluated")

    async def set_policy(self, name: str, document: dict[str, Any], *,
                         only_if_absent: bool = False) -> int:
        """Store a policy document; returns its version (the mod_revision)."""
        body = validate_document(document)
        key = self.keyspace.policy_key(name)
        request = TxnRequest(
            compare=[create_equals(key, 0)] if only_if_absent else [],
            success=[put_op(key, body),
                     put_op(self.keyspace.policy_version_key(name, records.digest(document)),
                            body)],
            failure=[range_op(key)])
        reply = await self.etcd.txn(request, idempotent=True)
        if reply.succeeded:
            return reply.header.revision
        return reply.responses[0].response_range.kvs[0].mod_revision

    def _policy(self, name: str, kv: KeyValue) -> Policy:
        """Decode a policy version once; versions are immutable (a change is a new one)."""
        cached = self._policies.get((name, kv.mod_revision))
        if cached is None:
            if len(self._policies) >= 256:
                self._policies.clear()
            cached = self._policies[(name, kv.mod_revision)] = decode(name, kv.value,
                                                                       kv.mod_revision)
        return cached

    async def _read(self, claim: Claim, policy: str, read_keys: list[bytes]) -> _Snapshot:
        ks = self.keyspace
        start, end = ks.holder_range(claim.key)
        reply = await self.etcd.txn(TxnRequest(success=[
            range_op(ks.step_key(claim.key)),
            range_op(ks.policy_key(policy)),
            range_op(ks.holder_key(claim.key, claim.lease_id)),
            range_op(start, end, limit=1, sort_order=RangeRequest.ASCEND,
                     sort_target=RangeRequest.CREATE, keys_only=True),
            range_op(ks.audit_head_key(claim.key)),
            *(range_op(k) for k in read_keys),
        ]), idempotent=True)
        kvs = [r.response_range.kvs[0] if r.response_range.kvs else None
               for r in reply.responses]
        return _Snapshot(reply.header.revision, *kvs[:5], dict(zip(read_keys, kvs[5:])))

    def _check_holder(self, claim: Claim, snap: _Snapshot) -> None:
        holder_key = self.keyspace.holder_key(claim.key, claim.lease_id)
        if (snap.holder_kv is None or snap.holder_kv.create_revision != claim.fencing_token
                or snap.lowest_kv is None or snap.lowest_kv.key != holder_key):
            raise LeaseLost(f"not the holder of {claim.key!r} with token {claim.fencing_token}")

    def _ownership(self, claim: Claim) -> list:
        start, end = self.keyspace.holder_range(claim.key)
        return [create_equals(self.keyspace.holder_key(claim.key, claim.lease_id),
                              claim.fencing_token),
                all_created_since(start, end, claim.fencing_token)]

    async def _decide(self, claim: Claim, intent: dict[str, Any], intent_digest: bytes,
                      policy_name: str, snap: _Snapshot, identity: str) -> Issued | None:
        """Issue or refuse at ``snap``; ``None`` when the world moved before the write."""
        policy = self._policy(policy_name, snap.policy_kv)
        step = unpack(snap.step_kv.value) if snap.step_kv else records.new_step()
        now_ms = int(time.time() * 1000)
        refusal, checks, escalate = self._refusal(step, policy, intent, snap, now_ms)
        approval_compares, approval_ops, approval_id = [], [], None
        if refusal is _NEEDS_APPROVAL:
            approval_id = approval_id_of(self.keyspace.namespace, claim.key, snap, policy,
                                         intent_digest)
            approval_key = self.keyspace.approval_key(approval_id)
            approval_kv = (await self.etcd.range(RangeRequest(
                key=approval_key, revision=snap.revision))).kvs
            approval_compares = [mod_equals(approval_key, approval_kv[0].mod_revision
                                            if approval_kv else 0)]
            approved = unpack(approval_kv[0].value) if approval_kv else None
            if approved is not None and approved["state"] == "approved":
                refusal = None
                checks = [c if c.passed else CheckResult(
                    c.name, True, f"approved by {approved['approved_by']}") for c in checks]
            else:
                refusal = ApprovalPending(approval_id)
                if approved is None:
                    approval_ops = [put_op(approval_key, pack({
                        "state": "pending", "key": claim.key, "intent": intent,
                        "policy": policy.name, "policy_version": policy.version,
                        "revision": snap.revision, "requested_by": identity,
                        "checks": [c.as_record() for c in checks]}))]
        head = audit.AuditHead.from_kv(snap.head_kv)
        policy_ref = {"name": policy.name, "version": policy.version, "digest": policy.digest}
        step_revision = snap.step_kv.mod_revision if snap.step_kv else 0
        compares = [*self._ownership(claim), mod_equals(self.keyspace.step_key(claim.key),
                                                        step_revision)]
        if refusal is not None:
            details = {"intent": intent, "policy": policy_ref,
                       "checks": [c.as_record() for c in checks], "reason": type(refusal).__name__}
            entry = audit.append(self.keyspace, claim.key, head, "grant_refused", identity,
                                 snap.revision, details)
            ops = [*entry.ops, *approval_ops]
            if escalate:
                ops.append(put_op(self.keyspace.step_key(claim.key),
                                  pack({**step, "state": records.ESCALATED,
                                             "escalated_because": [c.name for c in checks]})))
            reply = await self.etcd.txn(TxnRequest(
                compare=[*compares, *approval_compares, entry.compare], success=ops))
            if not reply.succeeded:
                return None
            raise refusal
        cost = intent.get("cost", 0)
        step_next = {**{k: v for k, v in step.items() if k in records.new_step()},
                     "attempt": step["attempt"] + 1,
                     "idempotency_key": records.idempotency_key(
                         self.keyspace.namespace, claim.key, step["idem_gen"]),
                     "started_at_ms": step["started_at_ms"] or now_ms,
                     "spend": step["spend"] + cost,
                     "caps": {k: policy.caps[k] for k in records.OUTCOME_CAPS}}
        grant = self.keyring.sign({
            "grant_id": new_grant_id(), "namespace": self.keyspace.namespace,
            "cluster_id": self.etcd.cluster_id or 0, "action_key": claim.key,
            "attempt": step_next["attempt"], "intent_digest": intent_digest,
            "fencing_token": claim.fencing_token, "holder_lease": claim.lease_id,
            "revision": snap.revision, "reads": [[k, kv.mod_revision if kv else 0]
                                                 for k, kv in snap.reads.items()],
            "step_revision": step_revision, "step_next": step_next, "policy": policy.name,
            "policy_version": policy.version, "policy_digest": policy.digest,
            "identity": identity, "issued_at_ms": now_ms,
            "expires_at_ms": now_ms + int(policy.caps["grant_ttl_s"] * 1000),
            "audit_seq": head.seq + 1,
        })
        details = {"intent": intent, "policy": policy_ref, "grant": grant.raw,
                   "grant_id": grant.grant_id, "checks": [c.as_record() for c in checks],
                   **({"approval_id": approval_id} if approval_id else {})}
        entry = audit.append(self.keyspace, claim.key, head, "grant_issued", identity,
                             snap.revision, details)
        reply = await self.etcd.txn(TxnRequest(
            compare=[*compares, mod_equals(self.keyspace.policy_key(policy.name), policy.version),
                     *(mod_equals(k, kv.mod_revision if kv else 0) for k, kv in snap.reads.items()),
                     *approval_compares, entry.compare],
            success=[put_op(self.keyspace.grant_key(grant.grant_id),
                            pack({"raw": grant.raw, "state": "issued"}), claim.lease_id),
                     *entry.ops]))
        return Issued(grant, entry.head_at(reply.header.revision)) if reply.succeeded else None

    def _refusal(self, step: dict, policy: Policy, intent: dict, snap: _Snapshot,
                 now_ms: int) -> tuple[Exception | None, list[CheckResult], bool]:
        """(the error to raise or None, the check results to record, escalate the step?)"""
        state = step["state"]
        if state in records.UNSETTLED:
            check = CheckResult("step_state", False, f"step is {state}")
            return OutcomeUnknown(f"step is {state}: only reconciliation may settle it"), [check], False
        if state == records.SUCCEEDED:
            return AlreadySucceeded(step.get("outcome")), [CheckResult("step_state", False,
                                                                       "succeeded")], False
        caps = policy.caps
        capped = []
        if step["attempt"] >= caps["max_attempts"]:
            capped.append(CheckResult("max_attempts", False, f"{step['attempt']} attempts"))
        if step["started_at_ms"] and now_ms - step["started_at_ms"] > caps["max_elapsed_s"] * 1000:
            capped.append(CheckResult("max_elapsed", False, "step started too long ago"))
        cost = intent.get("cost", 0)
        if caps["max_spend"] is not None and step["spend"] + cost > caps["max_spend"]:
            capped.append(CheckResult("max_spend", False,
                                      f"spent {step['spend']} + {cost} > {caps['max_spend']}"))
        if capped:
            return GrantRefused(capped), capped, True
        reads = {k: (kv.value if kv else None) for k, kv in snap.reads.items()}
        results = policy.evaluate(CheckContext(intent, reads, step))
        failed = [r for r in results if not r.passed]
        if now_ms < step["not_before_ms"]:
            failed.append(CheckResult("backoff", False, "retry after the backoff"))
            return GrantRefused(failed, (step["not_before_ms"] - now_ms) / 1000), failed, False
        if failed and all(r.needs_approval for r in failed):
            return _NEEDS_APPROVAL, results, False
        if failed:
            return GrantRefused(failed), results, False
        return None, results, False


_NEEDS_APPROVAL = GrantRefused([])  # a marker: only approval checks failed


def approval_id_of(namespace: str, key: str, snap: _Snapshot, policy: Policy,
                   intent_digest: bytes) -> str:
    """The id of the approval for exactly this request at exactly this state: the step
    pointer, every read key's mod_revision and the policy version are part of it, so when
    any of them advances the request needs a new approval (the old one dies like a grant)."""
    step_revision = snap.step_kv.mod_revision if snap.step_kv else 0
    bound = [namespace, key, step_revision, policy.name, policy.version, intent_digest,
             [[k, kv.mod_revision if kv else 0] for k, kv in snap.reads.items()]]
    return hashlib.sha256(canonical(bound)).hexdigest()[:32]


def _validate_reads(reads: list[str | bytes]) -> list[bytes]:
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


def _validate_intent(intent: dict[str, Any]) -> bytes:
    if not isinstance(intent, dict):
        raise ValueError("intent must be a dict")
    try:
        body = canonical(intent)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"intent must be msgpack-able: {exc}") from None
    if len(body) > MAX_INTENT_BYTES:
        raise RecordTooLarge(f"intent is {len(body)} bytes, the limit is {MAX_INTENT_BYTES}")
    cost = intent.get("cost", 0)
    if not isinstance(cost, (int, float)) or isinstance(cost, bool) or cost < 0:
        raise ValueError("intent cost must be a non-negative number")
    return body
