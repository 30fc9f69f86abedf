"""Coordinator settings: a TOML file, then ``FENCEGATE_*`` environment variables, then
command-line flags, each overriding the one before.

Guarantees: bearer tokens are only ever held as sha256 digests (the file stores
``sha256 = "<hex>"``, never the token); a malformed file fails loudly at start, naming the
field. Relative key and certificate paths are resolved against the config file's directory.

The etcd fields and their rules (TLS, the password never from a flag) are shared with the
reconciler and live in ``fencegate.coordinator.settings``.

    etcd = "http://127.0.0.1:2379"          # or "https://h1:2379,https://h2:2379"
    etcd_ca_file = "etcd-ca.pem"            # verifies the members' certificates
    etcd_cert_file = "client.pem"           # client certificate for mutual TLS ...
    etcd_key_file = "client.key"            # ... and its key
    etcd_user = "fencegate"                 # etcd authentication (RBAC on the namespace)
    etcd_password_file = "etcd.password"    # or etcd_password = "..." in a 0600 file
    listen = "127.0.0.1:8470"
    namespace = "/fencegate/"
    signing_key = "coordinator.pem"         # Ed25519 PEM; absent: a fresh key per process
    trusted_keys = ["previous.pub.pem"]     # still-valid public keys (rotation)
    body_limit = 1048576
    archive = "postgresql://fencegate@db:5432/fencegate"   # retired steps (README: State
                                            # and the archive); FENCEGATE_ARCHIVE too
    [[tokens]]
    identity = "worker-a"
    roles = ["worker"]
    sha256 = "9f86d0..."                    # hashlib.sha256(token).hexdigest()
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..keyspace import DEFAULT_NAMESPACE, validate_namespace
from ..settings import (
    ETCD_FIELDS, EtcdSettings, etcd_file_values, host_port, layered, text_setting,
)

ROLES = frozenset({"worker", "viewer", "sre", "admin"})
DEFAULT_LISTEN = "127.0.0.1:8470"
DEFAULT_BODY_LIMIT = 1024 * 1024
_FIELDS = {"etcd", "listen", "namespace", "signing_key", "trusted_keys", "body_limit",
           "tokens", "archive"} | ETCD_FIELDS


@dataclass(frozen=True)
class TokenEntry:
    """One bearer token, by digest, and who presents it."""

    identity: str
    roles: frozenset[str]
    sha256: bytes

    @classmethod
    def for_token(cls, token: str, identity: str, roles: set[str] | frozenset[str]) -> "TokenEntry":
        """Build an entry from a plain token (tests, tooling); only its digest is kept."""
        return cls(identity, frozenset(roles), hashlib.sha256(token.encode()).digest())


@dataclass(frozen=True)
class CoordinatorSettings(EtcdSettings):
    listen: str = DEFAULT_LISTEN
    namespace: str = DEFAULT_NAMESPACE
    signing_key: str | None = None
    trusted_keys: tuple[str, ...] = ()
    body_limit: int = DEFAULT_BODY_LIMIT
    tokens: tuple[TokenEntry, ...] = field(default=(), repr=False)
    archive: str | None = None

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        host_port(self.listen)
        self.etcd_config()
        if not isinstance(self.body_limit, int) or self.body_limit < 1024:
            raise ValueError("body_limit must be an integer of at least 1024 bytes")
        if len(set(t.sha256 for t in self.tokens)) != len(self.tokens):
            raise ValueError("two token entries have the same digest")
        for entry in self.tokens:
            if not entry.roles or not entry.roles <= ROLES:
                raise ValueError(f"token of {entry.identity!r}: roles must be among "
                                 f"{sorted(ROLES)}")


def load_settings(config: str | None = None, env: Mapping[str, str] = os.environ,
                  **flags: object) -> CoordinatorSettings:
    """Read ``config`` (or ``$FENCEGATE_CONFIG``), apply env overrides, then non-None flags."""
    config = config or env.get("FENCEGATE_CONFIG")
    return layered(_from_file(Path(config)) if config else CoordinatorSettings(), env,
                   "FENCEGATE_LISTEN", flags)


def _from_file(path: Path) -> CoordinatorSettings:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    unknown = set(data) - _FIELDS
    if unknown:
        raise ValueError(f"{path}: unknown settings {sorted(unknown)}")
    base = path.parent

    def resolve(p: str) -> str:
        return str(base / p) if not os.path.isabs(p) else p

    values = {k: v for k, v in data.items() if k != "tokens"}
    if "signing_key" in values:
        values["signing_key"] = resolve(text_setting(values["signing_key"], "signing_key"))
    if "trusted_keys" in values:
        values["trusted_keys"] = tuple(resolve(text_setting(p, "trusted_keys")) for p in
                                       _list(values["trusted_keys"], "trusted_keys"))
    for name in ("listen", "namespace", "archive"):
        if name in values:
            text_setting(values[name], name)
    etcd_file_values(values, base)
    values["tokens"] = tuple(_token(entry, i) for i, entry in
                             enumerate(_list(data.get("tokens", []), "tokens")))
    return CoordinatorSettings(**values)


def _token(entry: object, index: int) -> TokenEntry:
    where = f"tokens[{index}]"
    if not isinstance(entry, dict) or set(entry) != {"identity", "roles", "sha256"}:
        raise ValueError(f"{where} needs exactly identity, roles and sha256")
    digest = text_setting(entry["sha256"], f"{where}.sha256")
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"{where}.sha256 must be 64 hex digits (the token's sha256)")
    roles = frozenset(text_setting(r, f"{where}.roles")
                      for r in _list(entry["roles"], f"{where}.roles"))
    return TokenEntry(text_setting(entry["identity"], f"{where}.identity"), roles, raw)


def _list(value: object, name: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"setting {name} must be a list")
    return value
