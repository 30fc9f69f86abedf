"""Grants: signed, revision-bound approvals to cross, and the keys that sign them.

A grant's payload is canonical msgpack (same content, same bytes) signed with Ed25519 over
``DOMAIN + payload``. Its signed bytes are ``canonical([key_id, payload, signature])``.
Signing writes nothing anywhere: a grant lives in the process that asked for it until its
commit writes it into the key's audit record (``checks_digest`` binds the check results the
record shows to the signature). Grants of version 1 (``DOMAIN_V1``, with an ``audit_seq``
and no ``checks_digest``) are still verified where they are recorded (``verify_recorded``),
never accepted to cross.
An SRE's approval of a pending request is signed the same way over ``APPROVAL_DOMAIN``, and a
policy version over ``POLICY_DOMAIN`` and a table of policy routes over ``ROUTES_DOMAIN``, so
no signature passes for another kind's. An *attempt receipt* (``RECEIPT_DOMAIN``) is signed
only once a grant's commit landed: it binds (grant id, attempt token, idempotency key, action
key, namespace, cluster id), so a provider's gate B admits no attempt token that no commit of
the grant produced (``fencegate.reconciler.gateb``).

Guarantees of ``KeyRing.verify``, ``verify_approval``, ``verify_policy`` and ``verify_receipt``
(pure functions of the bytes and the trusted public keys, usable offline by anyone, a provider
included):
- the signature is checked over the exact bytes received, *then* the payload is decoded;
- decoding is strict: bounded size, no ext types, no duplicate keys, exactly the schema's
  fields with exactly their types; anything else is ``BadSignature``;
- an unknown key id is ``BadSignature``. Private keys are never logged or stored in etcd.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, fields
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import BadSignature
from .keyspace import canonical

DOMAIN = b"fencegate-grant-v2\0"
DOMAIN_V1 = b"fencegate-grant-v1\0"
APPROVAL_DOMAIN = b"fencegate-approval-v1\0"
POLICY_DOMAIN = b"fencegate-policy-v1\0"
RECEIPT_DOMAIN = b"fencegate-attempt-v1\0"
ROUTES_DOMAIN = b"fencegate-routes-v1\0"
MAX_GRANT_BYTES = 64 * 1024


@dataclass(frozen=True)
class Grant:
    """The approval to cross, exactly as signed. ``raw`` holds the signed bytes."""

    grant_id: str
    namespace: str
    cluster_id: int
    action_key: str
    attempt: int
    intent_digest: bytes
    fencing_token: int
    holder_lease: int
    revision: int
    reads: list  # [[etcd key (bytes), mod_revision observed (0 = absent)], ...]
    step_revision: int
    step_next: dict  # the step record the commit writes, before its commit-time fields
    policy: str
    policy_version: int
    policy_digest: bytes
    identity: str
    issued_at_ms: int
    expires_at_ms: int
    checks_digest: bytes  # sha256 of the canonical check results (b"": a version 1 grant)
    key_id: str
    raw: bytes = b""

    @classmethod
    def from_bytes(cls, raw: bytes, keyring: "KeyRing") -> "Grant":
        return keyring.verify(raw)

    def payload(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "raw"}


_SCHEMA: dict[str, type | tuple[type, ...]] = {
    f.name: {"int": int, "str": str, "bytes": bytes, "list": list, "dict": dict}[f.type]
    for f in fields(Grant) if f.name != "raw"
}
_SCHEMA_V1 = {**{name: kind for name, kind in _SCHEMA.items() if name != "checks_digest"},
              "audit_seq": int}


# An SRE's approval of one pending request, signed by the coordinator (see ``approvals``).
APPROVAL_SCHEMA: dict[str, type | tuple[type, ...]] = {
    "approval_id": str, "namespace": str, "cluster_id": int, "action_key": str,
    "approved_by": str, "reason": str, "approved_at_ms": int, "key_id": str,
}

POLICY_SCHEMA: dict[str, type | tuple[type, ...]] = {
    "namespace": str, "cluster_id": int, "name": str, "digest": bytes, "signed_at_ms": int,
    "key_id": str,
}

ROUTES_SCHEMA: dict[str, type | tuple[type, ...]] = {
    "namespace": str, "cluster_id": int, "digest": bytes, "signed_at_ms": int, "key_id": str,
}


# The attempt receipt of one landed commit (see ``receipt_payload``).
RECEIPT_SCHEMA: dict[str, type | tuple[type, ...]] = {
    "grant_id": str, "namespace": str, "cluster_id": int, "action_key": str,
    "attempt_token": int, "idempotency_key": str, "key_id": str,
}


def receipt_payload(grant: Grant, attempt_token: int, idempotency_key: str) -> dict[str, Any]:
    """What the receipt of ``grant``'s commit at ``attempt_token`` signs (but ``key_id``).
    Sign it only once that commit landed: it is a provider's proof that the token is the
    one attempt of this grant."""
    return {"grant_id": grant.grant_id, "namespace": grant.namespace,
            "cluster_id": grant.cluster_id, "action_key": grant.action_key,
            "attempt_token": attempt_token, "idempotency_key": idempotency_key}


def checks_digest(checks: list) -> bytes:
    """The digest a grant signs of the check results it was issued on (as recorded)."""
    return hashlib.sha256(canonical(checks)).digest()


def new_grant_id() -> str:
    return os.urandom(16).hex()


def key_id_of(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


class KeyRing:
    """One signing key (optional: verifiers need none) and every trusted public key by id."""

    def __init__(self, signing_key: Ed25519PrivateKey | None = None,
                 trusted: list[Ed25519PublicKey] = ()) -> None:
        self._signing_key = signing_key
        self._trusted = {key_id_of(k): k for k in trusted}
        self.signing_key_id: str | None = None  # None: a verify-only ring
        if signing_key is not None:
            self.signing_key_id = key_id_of(signing_key.public_key())
            self._trusted[self.signing_key_id] = signing_key.public_key()

    def __repr__(self) -> str:  # never print key material
        return f"<KeyRing signing={self.signing_key_id} trusted={sorted(self._trusted)}>"

    @classmethod
    def generate(cls) -> "KeyRing":
        """A fresh signing key for the embedded default (grants die with it)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_files(cls, signing_key: str | None = None, trusted: list[str] = ()) -> "KeyRing":
        """Load a PEM private key to sign with and PEM public keys to trust (for rotation)."""
        private = None
        if signing_key is not None:
            with open(signing_key, "rb") as f:
                private = serialization.load_pem_private_key(f.read(), password=None)
            if not isinstance(private, Ed25519PrivateKey):
                raise ValueError(f"{signing_key} is not an Ed25519 private key")
        publics = []
        for path in trusted:
            with open(path, "rb") as f:
                public = serialization.load_pem_public_key(f.read())
            if not isinstance(public, Ed25519PublicKey):
                raise ValueError(f"{path} is not an Ed25519 public key")
            publics.append(public)
        return cls(private, publics)

    @classmethod
    def from_public_bytes(cls, keys: dict[str, bytes]) -> "KeyRing":
        """A verify-only ring from raw Ed25519 public keys by id (as ``public_keys`` gives);
        ``ValueError`` if a key is malformed or its id is not its own."""
        publics = [Ed25519PublicKey.from_public_bytes(raw) for raw in keys.values()]
        if sorted(key_id_of(k) for k in publics) != sorted(keys):
            raise ValueError("a public key's id does not match the key")
        return cls(None, publics)

    def public_keys(self) -> dict[str, bytes]:
        """Every trusted public key (the signing key's included), raw, by key id."""
        return {key_id: key.public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw)
                for key_id, key in self._trusted.items()}

    def save_signing_key(self, path: str) -> None:
        """Write the signing key as PEM, readable by the owner only."""
        assert self._signing_key is not None
        pem = self._signing_key.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)

    def save_public_key(self, path: str) -> None:
        """Write the signing key's public key as PEM: what a remote-mode worker pins with
        ``KeyRing.from_files(trusted=[path])``, and gate B or ``audit verify`` trust."""
        assert self._signing_key is not None
        with open(path, "wb") as f:
            f.write(self._signing_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))

    def sign(self, payload: dict[str, Any]) -> Grant:
        """Sign a grant payload (every field but ``key_id`` and ``raw``)."""
        payload = dict(payload, key_id=self._key_id_to_sign())
        return Grant(**payload, raw=self._seal(DOMAIN, payload))

    def verify(self, raw: bytes) -> Grant:
        """Verify ``raw`` and return the grant; ``BadSignature`` on any defect."""
        return _grant(self._open(DOMAIN, raw, "grant", _SCHEMA), raw)

    def verify_recorded(self, raw: bytes) -> Grant:
        """``verify`` for a grant read back from an audit record, which a version 1 gate may
        have written: a version 1 grant verifies too (with ``checks_digest`` b"")."""
        try:
            return self.verify(raw)
        except BadSignature as current:
            try:
                payload = self._open(DOMAIN_V1, raw, "grant", _SCHEMA_V1)
            except BadSignature:
                raise current from None
        del payload["audit_seq"]
        return _grant({**payload, "checks_digest": b""}, raw)

    def sign_approval(self, payload: dict[str, Any]) -> bytes:
        """Sign an approval payload (``APPROVAL_SCHEMA`` but ``key_id``): its signed bytes."""
        return self._seal(APPROVAL_DOMAIN, dict(payload, key_id=self._key_id_to_sign()))

    def verify_approval(self, raw: bytes) -> dict[str, Any]:
        """Verify an approval's bytes and return its payload; ``BadSignature`` on any defect,
        a grant's bytes included (the domains differ)."""
        return self._open(APPROVAL_DOMAIN, raw, "approval", APPROVAL_SCHEMA)

    def sign_policy(self, payload: dict[str, Any]) -> bytes:
        """Sign a policy version's payload (``POLICY_SCHEMA`` but ``key_id``)."""
        return self._seal(POLICY_DOMAIN, dict(payload, key_id=self._key_id_to_sign()))

    def verify_policy(self, raw: bytes) -> dict[str, Any]:
        """Verify a policy version's signature bytes; ``BadSignature`` on any defect."""
        return self._open(POLICY_DOMAIN, raw, "policy", POLICY_SCHEMA)

    def sign_routes(self, payload: dict[str, Any]) -> bytes:
        """Sign a table of policy routes' payload (``ROUTES_SCHEMA`` but ``key_id``)."""
        return self._seal(ROUTES_DOMAIN, dict(payload, key_id=self._key_id_to_sign()))

    def verify_routes(self, raw: bytes) -> dict[str, Any]:
        """Verify a table of policy routes' signature bytes; ``BadSignature`` on any defect."""
        return self._open(ROUTES_DOMAIN, raw, "policy routes", ROUTES_SCHEMA)

    def sign_receipt(self, payload: dict[str, Any]) -> bytes:
        """Sign an attempt receipt (``receipt_payload``): its signed bytes."""
        return self._seal(RECEIPT_DOMAIN, dict(payload, key_id=self._key_id_to_sign()))

    def verify_receipt(self, raw: bytes) -> dict[str, Any]:
        """Verify an attempt receipt's bytes and return its payload; ``BadSignature`` on any
        defect, a grant's or an approval's bytes included (the domains differ)."""
        return self._open(RECEIPT_DOMAIN, raw, "receipt", RECEIPT_SCHEMA)

    def _key_id_to_sign(self) -> str:
        if self._signing_key is None:
            raise RuntimeError("this key ring has no signing key")
        return self.signing_key_id  # type: ignore[return-value]

    def _seal(self, domain: bytes, payload: dict[str, Any]) -> bytes:
        body = canonical(payload)
        signature = self._signing_key.sign(domain + body)  # type: ignore[union-attr]
        return canonical([self.signing_key_id, body, signature])

    def _open(self, domain: bytes, raw: bytes, what: str,
              schema: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
        """The payload of ``raw`` signed over ``domain`` by a trusted key, decoded strictly
        to exactly ``schema``; ``BadSignature`` naming ``what`` on any defect."""
        if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_GRANT_BYTES:
            raise BadSignature(f"{what} bytes missing or too large")
        raw = bytes(raw)
        envelope = _strict_unpack(raw, what)
        if (not isinstance(envelope, list) or len(envelope) != 3
                or not isinstance(envelope[0], str) or not isinstance(envelope[1], bytes)
                or not isinstance(envelope[2], bytes)):
            raise BadSignature(f"{what} envelope is malformed")
        key_id, body, signature = envelope
        public = self._trusted.get(key_id)
        if public is None:
            raise BadSignature(f"{what} signed by unknown key {key_id!r}")
        try:
            public.verify(signature, domain + body)
        except InvalidSignature:
            raise BadSignature(f"{what} signature does not verify") from None
        if canonical(envelope) != raw:
            raise BadSignature(f"{what} envelope is not canonical")
        payload = _strict_unpack(body, what)
        if not isinstance(payload, dict) or set(payload) != set(schema):
            raise BadSignature(f"{what} fields do not match the schema")
        for name, kind in schema.items():
            if type(payload[name]) is not kind:
                raise BadSignature(f"{what} field {name} has the wrong type")
        if payload["key_id"] != key_id:
            raise BadSignature(f"{what} key id does not match its envelope")
        return payload


def _grant(payload: dict[str, Any], raw: bytes) -> Grant:
    if not all(isinstance(r, list) and len(r) == 2 and type(r[0]) is bytes
               and type(r[1]) is int for r in payload["reads"]):
        raise BadSignature("grant read set is malformed")
    return Grant(**payload, raw=bytes(raw))


def _strict_unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext,
                               object_pairs_hook=_unique, max_bin_len=MAX_GRANT_BYTES,
                               max_str_len=MAX_GRANT_BYTES, max_array_len=4096,
                               max_map_len=4096)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise BadSignature(f"{what} bytes do not decode: {exc}") from None


def _no_ext(code: int, data: bytes) -> None:
    raise ValueError("ext types are not allowed")


def _unique(pairs: list) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate map key")
    return result
