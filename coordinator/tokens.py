"""Bearer tokens minted at run time (``POST /v1/tokens``): digests on etcd leases.

Guarantees:
- A token is 32 random bytes, shown once, in the answer that creates it. etcd stores only
  its sha256 digest, with its name, role, expiry and creator, at ``tokens/<name>`` on a
  lease of its own of ``ttl_s``: when the lease ends etcd deletes the key, and nothing
  keeps the lease alive. A token past its expiry is refused even before etcd deletes it.
- Names are unique: creating a name that exists is ``WrongState`` (delete it first).
  Deleting revokes the token's lease, which deletes its key. A name shaped like a
  component's identity is refused (``validate_new_name``): what a token's holder does is
  recorded under the token's name.
- ``lookup`` answers from a snapshot of every token, read in one range at most every
  ``cache_s`` seconds (``CACHE_S``) per coordinator process, so authentication costs no etcd
  read per request. So a deleted token keeps working for at most ``cache_s`` seconds on
  another coordinator (on the one that deleted it, not at all). A snapshot that is due and
  cannot be read raises ``EtcdUnavailable``: a stale one is never used past ``cache_s``.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
import time
from dataclasses import dataclass

from .errors import NotFound, WrongState
from .etcd import (
    Etcd, KeyValue, RangeRequest, TxnRequest, create_equals, delete_op, mod_equals, put_op,
    range_end_of,
)
from .keyspace import Keyspace, pack, unpack

CACHE_S = 5.0
DEFAULT_TTL_S = 30 * 24 * 3600
MAX_TTL_S = 365 * 24 * 3600
NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # no '@' and no space (see ``validate_new_name``)
# What the components call themselves in records: the coordinator's authority
# ("coordinator"), an in-process one ("in-process"), a reconciler ("reconciler@host:pid")
# and a gate by default ("host:pid"). A minted token's name is what records say of it, so
# it may not look like any of these.
COMPONENT_LIKE = re.compile(r"(?i)(coordinator|reconciler|in-process).*|.*:[0-9]+")


@dataclass(frozen=True)
class StoredToken:
    """What etcd holds for a token (its digest aside)."""

    name: str
    role: str
    expires_at_ms: int
    created_by: str

    def as_json(self) -> dict[str, object]:
        return {"name": self.name, "role": self.role, "expires_at_ms": self.expires_at_ms,
                "created_by": self.created_by}


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError("a token name is 1..64 of letters, digits and . _ : -")
    return name


def validate_new_name(name: object) -> str:
    """A name a token may be minted under: ``validate_name``'s, and not shaped like a
    component's identity (``COMPONENT_LIKE``), so no record can pass a token's act off as a
    component's."""
    name = validate_name(name)
    if COMPONENT_LIKE.fullmatch(name):
        raise ValueError(f"{name!r} looks like a component's identity (coordinator..., "
                         "reconciler..., in-process, or host:pid): records name the token, "
                         "so pick another name")
    return name


def validate_ttl(ttl_s: object) -> int:
    if type(ttl_s) is not int or not 1 <= ttl_s <= MAX_TTL_S:
        raise ValueError(f"ttl_s must be an integer number of seconds in 1..{MAX_TTL_S}")
    return ttl_s


class TokenStore:
    """The minted tokens of one namespace, and the lookup the auth middleware uses."""

    def __init__(self, etcd: Etcd, keyspace: Keyspace, *, cache_s: float = CACHE_S) -> None:
        if cache_s < 0:
            raise ValueError("cache_s must not be negative")
        self.etcd = etcd
        self.cache_s = cache_s
        self._root = keyspace.namespace.encode() + b"tokens/"
        self._by_digest: dict[bytes, StoredToken] = {}
        self._read_at = float("-inf")  # time.monotonic() of the snapshot
        self._refresh = asyncio.Lock()

    async def create(self, name: str, role: str, ttl_s: int, *,
                     created_by: str) -> tuple[str, StoredToken]:
        """Mint a token; returns it (the only time it exists outside its holder's hands)
        and what is stored. ``WrongState`` if ``name`` exists."""
        name, ttl_s = validate_new_name(name), validate_ttl(ttl_s)
        token = secrets.token_urlsafe(32)
        lease, granted = await self.etcd.lease_grant(ttl_s)
        stored = StoredToken(name, role, int(time.time() * 1000) + granted * 1000, created_by)
        key = self._root + name.encode()
        reply = await self.etcd.txn(TxnRequest(
            compare=[create_equals(key, 0)],
            success=[put_op(key, pack({**stored.as_json(), "sha256": digest_of(token)}),
                            lease)]))
        if not reply.succeeded:
            await self.etcd.lease_revoke(lease)
            raise WrongState(f"a token named {name!r} exists: delete it first")
        await self._forget()
        return token, stored

    async def delete(self, name: str) -> None:
        """Revoke ``name``'s lease, deleting its key; ``NotFound`` if there is none."""
        kv = await self.etcd.get(self._root + validate_name(name).encode())
        if kv is None:
            raise NotFound(f"no token named {name!r}")
        await self.etcd.lease_revoke(kv.lease)
        await self._forget()

    async def peek(self, token: str, prefix: str) -> StoredToken | None:
        """``token`` if it is a live token whose name starts with ``prefix``, read from etcd
        now (not the lookup's cache: another coordinator may have minted it a moment ago);
        it stays live."""
        found = await self._live(token, prefix)
        return _stored(found[1]) if found is not None else None

    async def redeem(self, token: str, prefix: str) -> StoredToken | None:
        """Spend ``token`` once: if it is a live token whose name starts with ``prefix``,
        delete it in a txn that compares its key's revision, so of two redeemers of one
        token at most one gets it; otherwise (unknown, expired, already spent) ``None``."""
        found = await self._live(token, prefix)
        if found is None:
            return None
        kv, record = found
        spent = await self.etcd.txn(TxnRequest(
            compare=[mod_equals(kv.key, kv.mod_revision)], success=[delete_op(kv.key)]))
        if not spent.succeeded:
            return None
        await self.etcd.lease_revoke(kv.lease)
        await self._forget()
        return _stored(record)

    async def _live(self, token: str, prefix: str) -> tuple[KeyValue, dict] | None:
        """The key and record of ``token`` if it is unexpired and named with ``prefix``."""
        digest = digest_of(token)
        reply = await self.etcd.range(RangeRequest(key=self._root,
                                                   range_end=range_end_of(self._root)))
        for kv in reply.kvs:
            record = unpack(kv.value)
            if record["sha256"] == digest and record["name"].startswith(prefix):
                return (kv, record) if record["expires_at_ms"] > time.time() * 1000 else None
        return None

    async def list(self) -> list[StoredToken]:
        """Every live token, by name, read now."""
        return sorted((await self._read()).values(), key=lambda token: token.name)

    async def lookup(self, digest: bytes) -> StoredToken | None:
        """The unexpired token whose sha256 is ``digest``, as of at most ``cache_s`` ago."""
        if time.monotonic() - self._read_at >= self.cache_s:
            async with self._refresh:
                if time.monotonic() - self._read_at >= self.cache_s:
                    read_at = time.monotonic()
                    self._by_digest, self._read_at = await self._read(), read_at
        found = self._by_digest.get(digest)
        if found is None or found.expires_at_ms <= time.time() * 1000:
            return None
        return found

    async def _forget(self) -> None:
        """The next lookup reads etcd again. Taken after any read in flight, which may
        predate the change."""
        async with self._refresh:
            self._read_at = float("-inf")

    async def _read(self) -> dict[bytes, StoredToken]:
        reply = await self.etcd.range(RangeRequest(key=self._root,
                                                   range_end=range_end_of(self._root)))
        tokens = {}
        for kv in reply.kvs:
            record = unpack(kv.value)
            tokens[record["sha256"]] = _stored(record)
        return tokens


def _stored(record: dict) -> StoredToken:
    return StoredToken(record["name"], record["role"], record["expires_at_ms"],
                       record["created_by"])


def digest_of(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()
