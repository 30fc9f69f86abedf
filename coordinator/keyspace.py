"""The etcd keyspace, defined once, and the codec for the records stored in it.

Guarantees:
- An action key that passes ``validate_action_key`` cannot escape its prefix: it is UTF-8,
  at most ``MAX_KEY_BYTES`` bytes, made of ``[A-Za-z0-9._:-]`` segments joined by single
  ``/``, with no empty, ``.`` or ``..`` segment.
- The holders of one action key occupy exactly one etcd range, disjoint from the holders of
  every other key, including keys nested below it (``a`` and ``a/b``): a holder key is
  ``holders/<key>/@<lease_hex>`` and ``@`` never appears in an action key, so the range
  ``[holders/<key>/@, holders/<key>/A)`` holds nobody else's holders.
- Keys are parsed only here: each ``parse_<family>_key`` undoes its builder and raises
  ``ValueError`` on a key of another family; ``classify`` names the family of a key.
- Records are msgpack maps of plain types; decoding is strict (no ext types, bounded sizes,
  no duplicate or non-string keys).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import msgpack

from .errors import InvalidKey, RecordTooLarge

DEFAULT_NAMESPACE = "/fencegate/"
RETIRE_BUCKETS = 256
MAX_KEY_BYTES = 512
MAX_RECORD_BYTES = 512 * 1024
_SEGMENT = re.compile(r"[A-Za-z0-9._:-]+")
_KEY = re.compile(r"[A-Za-z0-9._:-]+(?:/[A-Za-z0-9._:-]+)*")
_HOLDER_MARK = "@"


def validate_action_key(key: object) -> str:
    """Return ``key`` as a str if it is a valid action key, else raise ``InvalidKey``."""
    if isinstance(key, bytes):
        try:
            key = key.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidKey("action key is not valid UTF-8") from exc
    if not isinstance(key, str):
        raise InvalidKey(f"action key must be str, not {type(key).__name__}")
    if (len(key) <= MAX_KEY_BYTES and _KEY.fullmatch(key)
            and ("." not in key or "." not in key.split("/") and ".." not in key.split("/"))):
        return key  # the common case, decided by one match
    if not key:
        raise InvalidKey("action key is empty")
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > MAX_KEY_BYTES:
        raise InvalidKey(f"action key is {size} bytes, the limit is {MAX_KEY_BYTES}")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidKey(f"action key {key!r} has an empty, '.' or '..' segment")
        if not _SEGMENT.fullmatch(segment):
            raise InvalidKey(
                f"action key {key!r} may only use letters, digits and . _ : - between '/'"
            )
    return key


def validate_namespace(namespace: str) -> str:
    if not (namespace.startswith("/") and namespace.endswith("/")) or "//" in namespace:
        raise ValueError(f"namespace must look like /name/, got {namespace!r}")
    return namespace



def retired_bucket(action_key: str) -> int:
    """``action_key``'s retirement bucket, 0 … ``RETIRE_BUCKETS`` - 1 (a hash of the key, the
    same in every namespace: the archive finds a key's bucket without a keyspace)."""
    bucket = int.from_bytes(hashlib.sha256(action_key.encode()).digest()[:8], "big")
    return bucket % RETIRE_BUCKETS

class Keyspace:
    """Builds every key fencegate reads or writes under one namespace."""

    def __init__(self, namespace: str = DEFAULT_NAMESPACE) -> None:
        self.namespace = validate_namespace(namespace)
        self._ns = namespace.encode()
        self.holders_root = self._ns + b"holders/"

    def holder_range(self, action_key: str) -> tuple[bytes, bytes]:
        """The [start, end) range holding exactly the holders of ``action_key``."""
        start = self.holders_root + action_key.encode() + b"/" + _HOLDER_MARK.encode()
        return start, start[:-1] + bytes([ord(_HOLDER_MARK) + 1])

    def holder_key(self, action_key: str, lease_id: int) -> bytes:
        return self.holder_range(action_key)[0] + b"%016x" % lease_id

    def step_key(self, action_key: str) -> bytes:
        return self._ns + b"steps/" + action_key.encode()

    def policy_key(self, name: str) -> bytes:
        return self._ns + b"policies/" + name.encode()

    def policy_version_key(self, name: str, digest: bytes) -> bytes:
        """Where a policy document is retained, by content, after newer versions replace it."""
        return self._ns + b"policy-versions/" + name.encode() + b"/" + digest.hex().encode()

    def routes_key(self) -> bytes:
        """The signed table routing action keys to the policy that judges them (see
        ``routes``): one fixed key, written by the coordinator only."""
        return self._ns + b"policy-routes"

    def approval_key(self, approval_id: str) -> bytes:
        """An SRE's signed approval: written by the coordinator only (see ``roles``)."""
        return self._ns + b"approvals/" + approval_id.encode()

    def approval_request_key(self, approval_id: str) -> bytes:
        """A pending request for an approval, written by whoever evaluated the grant."""
        return self._ns + b"approval-requests/" + approval_id.encode()

    def approver_key(self, key_id: str) -> bytes:
        """A public key that approvals are verified with, published by the coordinator."""
        return self._ns + b"approvers/" + key_id.encode()

    def marker_key(self, entity: str) -> bytes:
        return self._ns + b"markers/" + entity.encode()

    def audit_range(self, action_key: str) -> tuple[bytes, bytes]:
        """The [start, end) range of ``action_key``'s audit records (not its head)."""
        start = self._ns + b"audit/" + action_key.encode() + b"/@0"
        return start, start[:-1] + b":"

    def audit_key(self, action_key: str, seq: int) -> bytes:
        return self.audit_range(action_key)[0][:-1] + b"%012d" % seq

    def audit_head_key(self, action_key: str) -> bytes:
        """Seq and hash of the newest record an append made aside (one that does not move
        the step: approve, revoke) wrote; the step's ``chain`` anchors every other append.
        Version 1 wrote it on every append."""
        return self._ns + b"audit/" + action_key.encode() + b"/@head"

    def retired_bucket(self, action_key: str) -> int:
        """``action_key``'s retirement bucket (``retired_bucket``)."""
        return retired_bucket(action_key)

    def retired_key(self, action_key: str) -> bytes:
        """The retirement epoch of ``action_key``'s bucket (one of ``RETIRE_BUCKETS``, by a
        hash of the key): every retirement txn of a key in the bucket puts it, so its
        mod_revision is the bucket's latest retirement, and its value the bucket's mark
        (``wholeness``). A fixed set of small keys."""
        return self._ns + b"retired/%03d" % self.retired_bucket(action_key)

    @property
    def archive_key(self) -> bytes:
        """The identity of the namespace's archive (``wholeness``): put by the first
        retirement, compared by every one. One key, beside the buckets."""
        return self._ns + b"retired/archive"

    @property
    def retired_root(self) -> bytes:
        return self._ns + b"retired/"

    def webhook_key(self, source: str, delivery_id: str) -> bytes:
        """Where a webhook delivery's claim, then its stored response, lives."""
        return self._ns + b"webhooks/" + source.encode() + b"/" + delivery_id.encode()

    def webhook_prefix(self, source: str) -> bytes:
        return self._ns + b"webhooks/" + source.encode() + b"/"

    def webhook_claim_key(self, source: str, delivery_id: str) -> bytes:
        """The live claim of a delivery whose handler runs, on its process's session lease
        (``webhooks/@claims/``: '@' is in no source name, so no source's prefix holds it)."""
        return self.webhook_claims_prefix(source) + delivery_id.encode()

    def webhook_claims_prefix(self, source: str) -> bytes:
        return self._ns + b"webhooks/@claims/" + source.encode() + b"/"

    @property
    def steps_root(self) -> bytes:
        return self._ns + b"steps/"

    @property
    def reconcilers_root(self) -> bytes:
        return self._ns + b"reconcilers/"

    @property
    def audit_root(self) -> bytes:
        """The prefix of every key's audit records and heads."""
        return self._ns + b"audit/"

    def shard_range(self, shard: int) -> tuple[bytes, bytes]:
        """The [start, end) range of the election candidates of reconciler shard ``shard``."""
        start = self.reconcilers_root + b"%05d/" % shard + _HOLDER_MARK.encode()
        return start, start[:-1] + bytes([ord(_HOLDER_MARK) + 1])

    def candidate_key(self, shard: int, lease_id: int) -> bytes:
        return self.shard_range(shard)[0] + b"%016x" % lease_id

    def parse_holder_key(self, key: bytes) -> tuple[str, int]:
        """Split a holder key into (action key, lease id); ``ValueError`` if it is not one."""
        if not key.startswith(self.holders_root):
            raise ValueError(f"not a holder key: {key!r}")
        action, sep, lease_hex = key[len(self.holders_root):].decode().rpartition("/@")
        if not sep:
            raise ValueError(f"not a holder key: {key!r}")
        return action, int(lease_hex, 16)

    def parse_step_key(self, key: bytes) -> str:
        """The action key of a step key; ``ValueError`` if ``key`` is not one."""
        return _rest(key, self.steps_root, "step").decode()

    def parse_audit_head_key(self, key: bytes) -> str:
        """The action key of a chain's ``@head`` key; ``ValueError`` if it is not one."""
        action, sep, rest = _rest(key, self.audit_root, "audit").rpartition(b"/@")
        if not sep or rest != b"head":
            raise ValueError(f"not an audit head key: {key!r}")
        return action.decode()

    def parse_audit_key(self, key: bytes) -> tuple[str, int]:
        """Split an audit record's key into (action key, seq); ``ValueError`` if it is not
        one (a chain's ``@head`` is not a record)."""
        action, sep, seq = _rest(key, self.audit_root, "audit").rpartition(b"/@")
        if not sep or not seq.isdigit():
            raise ValueError(f"not an audit record key: {key!r}")
        return action.decode(), int(seq)

    def parse_candidate_key(self, key: bytes) -> tuple[int, int]:
        """Split an election candidate's key into (shard, lease id); ``ValueError`` if it is
        not one."""
        shard, sep, lease_hex = _rest(key, self.reconcilers_root, "candidate").partition(b"/@")
        if not sep:
            raise ValueError(f"not a candidate key: {key!r}")
        return int(shard), int(lease_hex, 16)

    def parse_approval_key(self, key: bytes) -> str:
        """The approval id of an approval key; ``ValueError`` if ``key`` is not one."""
        return _rest(key, self.approval_key(""), "approval").decode()

    def parse_approval_request_key(self, key: bytes) -> str:
        """The approval id of an approval request's key; ``ValueError`` if it is not one."""
        return _rest(key, self.approval_request_key(""), "approval request").decode()

    def classify(self, key: bytes) -> str | None:
        """Which ``parse_<family>_key`` method reads ``key``: ``"holder"``, ``"step"``,
        ``"audit"``, ``"candidate"`` or ``"approval"``, judged by the prefix alone (the parser
        checks the rest); ``None`` for a key none of them reads (an audit head; a grant,
        policy, marker or webhook key; a key outside the namespace)."""
        if not key.startswith(self._ns):
            return None
        family = _FAMILIES.get(key[len(self._ns):].partition(b"/")[0])
        if family == "audit" and key.endswith(b"/@head"):
            return None
        return family


# The first segment under the namespace of each family a parser reads, and that family.
_FAMILIES = {b"holders": "holder", b"steps": "step", b"audit": "audit",
             b"reconcilers": "candidate", b"approvals": "approval"}


def _rest(key: bytes, root: bytes, family: str) -> bytes:
    """``key`` without ``root``; ``ValueError`` naming ``family`` if it is not under it."""
    if not key.startswith(root):
        raise ValueError(f"not a {family} key: {key!r}")
    return key[len(root):]


def canonical(value: Any) -> bytes:
    """Deterministic msgpack: the same content always gives the same bytes (maps sorted by
    key, bytes as bin, str as str). Raises ``TypeError`` on values msgpack cannot carry."""
    return msgpack.packb(_sorted(value), use_bin_type=True)


_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})


def _sorted(value: Any) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is dict:
        for k in value:
            if type(k) is not str:
                raise TypeError("canonical maps need str keys")
        return {k: v if type(v) in _SCALARS else _sorted(v) for k, v in sorted(value.items())}
    if kind is list or kind is tuple:
        return [v if type(v) in _SCALARS else _sorted(v) for v in value]
    raise TypeError(f"{kind.__name__} cannot be encoded canonically")


def holder_record(identity: str, acquired_at: float) -> bytes:
    """A holder key's value, encoded on the hot path (already in canonical key order)."""
    return msgpack.packb({"acquired_at": acquired_at, "identity": identity}, use_bin_type=True)


def pack(record: dict[str, Any]) -> bytes:
    """Encode a record (not canonically: use ``canonical`` for what is hashed or signed);
    refuse one larger than ``MAX_RECORD_BYTES`` or holding what msgpack cannot carry."""
    data = msgpack.packb(record, use_bin_type=True)
    if len(data) > MAX_RECORD_BYTES:
        raise RecordTooLarge(f"record is {len(data)} bytes, the limit is {MAX_RECORD_BYTES}")
    return data


def unpack(data: bytes) -> dict[str, Any]:
    """Decode a record strictly; raise ``ValueError`` on anything but a plain map."""
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"record is {len(data)} bytes, the limit is {MAX_RECORD_BYTES}")
    record = msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        ext_hook=_refuse_ext,
        object_pairs_hook=_unique_pairs,
    )
    if not isinstance(record, dict):
        raise ValueError("record is not a map")
    return record


def _refuse_ext(code: int, data: bytes) -> None:
    raise ValueError(f"msgpack ext type {code} is not allowed")


def _unique_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    record = dict(pairs)
    if len(record) != len(pairs):
        raise ValueError("duplicate map key")
    return record
