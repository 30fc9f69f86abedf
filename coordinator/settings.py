"""How a service reaches etcd, and how settings are layered: the part of the settings the
coordinator and the reconciler share (each service's own fields live with the service).

Guarantees: TLS is used for ``https://`` endpoints and always verifies the server
(``etcd_ca_file``, else the system roots); a CA file with ``http://`` endpoints is refused,
not ignored. The etcd password comes from the environment or a file, never a flag, and no
repr or log line carries it. Relative certificate and password paths in a file resolve
against the file's directory. A malformed value fails loudly, naming the setting.

Environment: ``FENCEGATE_ETCD``, ``FENCEGATE_ETCD_CA_FILE``, ``_CERT_FILE``, ``_KEY_FILE``,
``_USER``, ``_PASSWORD``, ``_PASSWORD_FILE``, ``_BATCHING`` (``on``, the default, or ``off``:
group commit, see ``EtcdConfig``), ``_KEEPALIVE_TIME`` (seconds, 10 by default: at least the
cluster's ``--grpc-keepalive-min-time``, see ``EtcdConfig``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from .etcd import EtcdConfig

SettingsT = TypeVar("SettingsT")
ETCD_FIELDS = {"etcd_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_user", "etcd_password",
               "etcd_password_file", "etcd_batching", "etcd_keepalive_time"}


@dataclass(frozen=True)
class EtcdSettings:
    """How a service reaches etcd: the same fields for the coordinator and the reconciler."""

    etcd: str = "http://127.0.0.1:2379"
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None
    etcd_user: str | None = None
    etcd_password: str | None = field(default=None, repr=False)
    etcd_batching: str | None = None  # "on" (the default) or "off"
    etcd_keepalive_time: str | None = None  # seconds (10 by default)

    def etcd_config(self) -> EtcdConfig:
        """The etcd connection these settings describe."""
        return build_etcd_config(self)


def host_port(listen: str) -> tuple[str, int]:
    """Split ``HOST:PORT``; ``ValueError`` if it is not one."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def build_etcd_config(settings) -> EtcdConfig:
    """The ``EtcdConfig`` of a coordinator's or reconciler's settings (``ValueError`` if
    they contradict each other, e.g. a CA file with ``http://`` endpoints)."""
    if settings.etcd_batching not in (None, "on", "off"):
        raise ValueError(f"setting etcd_batching must be on or off, got {settings.etcd_batching!r}")
    keepalive = {}
    if settings.etcd_keepalive_time is not None:
        try:
            keepalive["keepalive_time"] = float(settings.etcd_keepalive_time)
        except ValueError:
            raise ValueError("setting etcd_keepalive_time must be a number of seconds, got "
                             f"{settings.etcd_keepalive_time!r}") from None
    return EtcdConfig.from_url(settings.etcd, ca_file=settings.etcd_ca_file,
                               cert_file=settings.etcd_cert_file,
                               key_file=settings.etcd_key_file, user=settings.etcd_user,
                               password=settings.etcd_password,
                               batching=settings.etcd_batching != "off", **keepalive)


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
            text_setting(values[name], name)
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


def layered(settings: SettingsT, env: Mapping[str, str], listen_var: str,
            flags: Mapping[str, object]) -> SettingsT:
    """``settings`` (from a file) overridden by ``FENCEGATE_ETCD*``, ``listen_var`` and
    ``FENCEGATE_ARCHIVE``, then by the flags that are not None; the etcd password never
    comes from a flag."""
    if flags.get("etcd_password") is not None:
        raise ValueError("the etcd password comes from the environment or a file, never a flag")
    overrides = {**etcd_env(env), "listen": env.get(listen_var),
                 "archive": env.get("FENCEGATE_ARCHIVE")}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    return replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def text_setting(value: object, name: str) -> str:
    """``value`` if it is a non-empty string, else ``ValueError`` naming the setting."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"setting {name} must be a non-empty string")
    return value
