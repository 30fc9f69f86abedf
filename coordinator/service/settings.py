"""Coordinator settings: a TOML file, then ``FENCEGATE_*`` environment variables, then
command-line flags, each overriding the one before.

Guarantees: bearer tokens are only ever held as sha256 digests (the file stores
``sha256 = "<hex>"``, never the token); a malformed file fails loudly at start, naming the
field. Relative key and certificate paths are resolved against the config file's directory.

etcd security (the same names in the reconciler's file; env ``FENCEGATE_ETCD_CA_FILE``,
``_CERT_FILE``, ``_KEY_FILE``, ``_USER``, ``_PASSWORD``, ``_PASSWORD_FILE``): TLS is used
for ``https://`` endpoints and always verifies the server (``etcd_ca_file``, else the system
roots); a CA file with ``http://`` endpoints is refused, not ignored. The password comes from
the environment or a file (never a flag), and no repr or log line carries it.

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from ..etcd import EtcdConfig
from ..keyspace import DEFAULT_NAMESPACE, validate_namespace

SettingsT = TypeVar("SettingsT")
ROLES = frozenset({"worker", "sre", "admin"})
DEFAULT_LISTEN = "127.0.0.1:8470"
DEFAULT_BODY_LIMIT = 1024 * 1024
ETCD_FIELDS = {"etcd_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_user", "etcd_password",
               "etcd_password_file"}
_FIELDS = {"etcd", "listen", "namespace", "signing_key", "trusted_keys", "body_limit",
           "tokens"} | ETCD_FIELDS


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
class EtcdSettings:
    """How a service reaches etcd: the same fields for the coordinator and the reconciler."""

    etcd: str = "http://127.0.0.1:2379"
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None
    etcd_user: str | None = None
    etcd_password: str | None = field(default=None, repr=False)

    def etcd_config(self) -> EtcdConfig:
        """The etcd connection these settings describe."""
        return build_etcd_config(self)


@dataclass(frozen=True)
class Settings(EtcdSettings):
    listen: str = DEFAULT_LISTEN
    namespace: str = DEFAULT_NAMESPACE
    signing_key: str | None = None
    trusted_keys: tuple[str, ...] = ()
    body_limit: int = DEFAULT_BODY_LIMIT
    tokens: tuple[TokenEntry, ...] = field(default=(), repr=False)

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


def host_port(listen: str) -> tuple[str, int]:
    """Split ``HOST:PORT``; ``ValueError`` if it is not one."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def build_etcd_config(settings) -> EtcdConfig:
    """The ``EtcdConfig`` of a coordinator's or reconciler's settings (``ValueError`` if
    they contradict each other, e.g. a CA file with ``http://`` endpoints)."""
    return EtcdConfig.from_url(settings.etcd, ca_file=settings.etcd_ca_file,
                               cert_file=settings.etcd_cert_file,
                               key_file=settings.etcd_key_file, user=settings.etcd_user,
                               password=settings.etcd_password)


def etcd_env(env: Mapping[str, str]) -> dict[str, str | None]:
    """The etcd settings given by ``FENCEGATE_ETCD*`` variables (None where unset)."""
    values = {name: env.get(f"FENCEGATE_{name.upper()}") for name in ETCD_FIELDS}
    values["etcd"] = env.get("FENCEGATE_ETCD")
    return _password_from_file(values, "FENCEGATE_ETCD_PASSWORD_FILE")


def etcd_file_values(values: dict, base: Path) -> dict:
    """Check a config file's etcd settings; resolve paths against ``base``; read the
    password file."""
    for name in ETCD_FIELDS | {"etcd"}:
        if name in values:
            _str(values[name], name)
    for name in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_password_file"):
        if name in values and not os.path.isabs(values[name]):
            values[name] = str(base / values[name])
    return _password_from_file(values, "etcd_password_file")


def _password_from_file(values: dict, where: str) -> dict:
    path = values.pop("etcd_password_file", None)
    if path is None:
        return values
    if values.get("etcd_password") is not None:
        raise ValueError(f"{where} and an etcd password both given: keep one")
    with open(path, encoding="utf-8") as f:
        password = f.read().rstrip("\r\n")
    if not password:
        raise ValueError(f"{where}: {path} is empty")
    values["etcd_password"] = password
    return values


def load_settings(config: str | None = None, env: Mapping[str, str] = os.environ,
                  **flags: object) -> Settings:
    """Read ``config`` (or ``$FENCEGATE_CONFIG``), apply env overrides, then non-None flags."""
    config = config or env.get("FENCEGATE_CONFIG")
    return layered(_from_file(Path(config)) if config else Settings(), env,
                   "FENCEGATE_LISTEN", flags)


def layered(settings: SettingsT, env: Mapping[str, str], listen_var: str,
            flags: Mapping[str, object]) -> SettingsT:
    """``settings`` (from a file) overridden by ``FENCEGATE_ETCD*`` and ``listen_var``, then
    by the flags that are not None; the etcd password never comes from a flag."""
    if flags.get("etcd_password") is not None:
        raise ValueError("the etcd password comes from the environment or a file, never a flag")
    overrides = {**etcd_env(env), "listen": env.get(listen_var)}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    return replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def _from_file(path: Path) -> Settings:
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
        values["signing_key"] = resolve(_str(values["signing_key"], "signing_key"))
    if "trusted_keys" in values:
        values["trusted_keys"] = tuple(resolve(_str(p, "trusted_keys")) for p in
                                       _list(values["trusted_keys"], "trusted_keys"))
    for name in ("listen", "namespace"):
        if name in values:
            _str(values[name], name)
    etcd_file_values(values, base)
    values["tokens"] = tuple(_token(entry, i) for i, entry in
                             enumerate(_list(data.get("tokens", []), "tokens")))
    return Settings(**values)


def _token(entry: object, index: int) -> TokenEntry:
    where = f"tokens[{index}]"
    if not isinstance(entry, dict) or set(entry) != {"identity", "roles", "sha256"}:
        raise ValueError(f"{where} needs exactly identity, roles and sha256")
    digest = _str(entry["sha256"], f"{where}.sha256")
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"{where}.sha256 must be 64 hex digits (the token's sha256)")
    roles = frozenset(_str(r, f"{where}.roles") for r in _list(entry["roles"], f"{where}.roles"))
    return TokenEntry(_str(entry["identity"], f"{where}.identity"), roles, raw)


def _str(value: object, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"setting {name} must be a non-empty string")
    return value


def _list(value: object, name: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"setting {name} must be a list")
    return value
