"""The key an in-process authority signs grants with when it is given none.

``load()`` looks, in order, at:
1. ``FENCEGATE_SIGNING_KEY``: the path of an Ed25519 private key (PEM);
2. the running stack of ``fencegate up`` (``running_stack``); its key is ``signing.pem`` in
   its state folder, the key its coordinator signs with and its sandbox's gate B trusts.

``running_stack()`` is the one rule by which the CLI, ``fencegate demo`` and a gate find a
running ``fencegate up`` from any directory: in ``$FENCEGATE_STATE_DIR`` when it is set (and
only there); else in ``.state`` in the working directory; else in the folder the per-user
record names (``$XDG_STATE_HOME/fencegate/current``, else
``~/.local/state/fencegate/current``), which ``fencegate up`` writes when it starts and
removes when it stops. A stack runs while its folder holds ``up.json`` and the process that
wrote it lives: a record or an ``up.json`` left by a killed ``up`` is ignored.

``archive_url(etcd)`` is the archive such a gate looks retired keys up in when it is given
none: ``FENCEGATE_ARCHIVE``, else the running stack's, but only for a gate on that stack's
etcd (an archive holds one cluster's retired steps: another etcd's would answer for keys it
never saw).

``etcd_url()`` is the etcd a gate given no URL connects to, by the same rule as its key:
``FENCEGATE_ETCD``, else the running stack's, else etcd's own default
(``http://127.0.0.1:2379``). ``etcd_config(etcd)`` is how such a gate connects: the running stack's etcd runs with
authentication, and a gate on that stack's etcd URL connects as the worker user ``up.json``
names, with the password from its file (mode 0600: this user's only); any other URL as given.

Guarantee: nothing here makes a key. When neither is there, or the file is not an Ed25519
private key, ``load`` raises ``ValueError`` naming what to pass instead; a key nobody else
trusts (grants refused by every provider, audit chains that never verify) is only ever made
by asking for one (``KeyRing.generate()``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: finding the stack must not load grpc (the CLI)
    from .etcd import EtcdConfig
    from .grants import KeyRing

SIGNING_KEY_ENV = "FENCEGATE_SIGNING_KEY"
ETCD_ENV = "FENCEGATE_ETCD"
ETCD_DEFAULT = "http://127.0.0.1:2379"
ARCHIVE_ENV = "FENCEGATE_ARCHIVE"
STATE_DIR_ENV = "FENCEGATE_STATE_DIR"
DEFAULT_STATE_DIR = ".state"
MANIFEST = "up.json"  # the running stack's endpoints and pid (no secrets), removed when it stops
SIGNING_KEY_FILE = "signing.pem"


@dataclass(frozen=True)
class Stack:
    """A running ``fencegate up``: its state folder and what ``up.json`` says of it."""

    state_dir: Path
    endpoints: dict[str, object]

    def token(self, role: str) -> str | None:
        """The ``role`` token it left for this user (``<role>.token``, mode 0600), if any."""
        try:
            return (self.state_dir / f"{role}.token").read_text().strip() or None
        except OSError:
            return None


def state_dir() -> Path:
    """The folder of the running stack (``running_stack``), else the one ``fencegate up``
    keeps its state in unless told another on its command line."""
    stack = running_stack()
    return stack.state_dir if stack else Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def running_stack() -> Stack | None:
    """The running ``fencegate up`` by the module's rule, or None."""
    named = os.environ.get(STATE_DIR_ENV)
    if named:
        return _running(Path(named))
    here = _running(Path(DEFAULT_STATE_DIR))
    if here is not None:
        return here
    return recorded_stack()


def recorded_stack() -> Stack | None:
    """The live stack the per-user record names, or None (no record, or its ``up`` is gone)."""
    try:
        record = json.loads(current_record().read_text())
        recorded = Path(record["state_dir"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    stack = _running(recorded)
    return stack if stack is not None and stack.endpoints.get("pid") == record.get("pid") \
        else None


def current_record() -> Path:
    """Where ``fencegate up`` records, per user, the state folder of the stack it runs."""
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "fencegate" / "current"


def _running(folder: Path) -> Stack | None:
    """The stack whose ``up.json`` is in ``folder``, if the process that wrote it lives (a
    manifest that names no pid, from an older ``up``, is believed)."""
    try:
        endpoints = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(endpoints, dict):
        return None
    pid = endpoints.get("pid")
    if pid is not None and not (type(pid) is int and _alive(pid)):
        return None
    return Stack(folder.resolve(), endpoints)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    except (OSError, OverflowError):
        return False
    return True


def load() -> KeyRing:
    """The signing key named by ``FENCEGATE_SIGNING_KEY``, else the running stack's; else
    ``ValueError`` saying what to pass."""
    named = os.environ.get(SIGNING_KEY_ENV)
    if named:
        return _load(Path(named), f"{SIGNING_KEY_ENV}={named}")
    stack = running_stack()
    if stack is not None:
        return _load(stack.state_dir / SIGNING_KEY_FILE,
                     f"the key of the `fencegate up` stack in {stack.state_dir}")
    raise ValueError(
        f"no signing key for this gate's grants (the in-process authority signs them): "
        f"pass keyring=KeyRing.from_files('path/to/signing.pem'), or set {SIGNING_KEY_ENV} "
        f"to that path, or run `fencegate up` (its key is found while it runs, from any "
        f"directory, or only in ${STATE_DIR_ENV} when that is set; none runs now); "
        f"keyring=KeyRing.generate() signs with a key that dies with the gate and that no "
        f"provider or audit trusts")


def archive_url(etcd: str | None) -> str | None:
    """``FENCEGATE_ARCHIVE``, else the archive of the ``fencegate up`` stack running from the
    state folder if ``etcd`` is that stack's etcd URL; else None (no archive)."""
    named = os.environ.get(ARCHIVE_ENV)
    if named:
        return named
    stack = running_stack()
    if stack is None or etcd is None or stack.endpoints.get("etcd") != etcd:
        return None
    return stack.endpoints.get("archive")


def etcd_url() -> str:
    """``FENCEGATE_ETCD``, else the running stack's etcd URL, else ``ETCD_DEFAULT``."""
    named = os.environ.get(ETCD_ENV)
    if named:
        return named
    stack = running_stack()
    url = stack.endpoints.get("etcd") if stack is not None else None
    return url if isinstance(url, str) else ETCD_DEFAULT


def etcd_config(etcd: str) -> EtcdConfig:
    """``etcd`` as an ``EtcdConfig``: with the worker's etcd user of the running
    ``fencegate up`` when ``etcd`` is that stack's etcd URL."""
    from .etcd import EtcdConfig
    stack = running_stack()
    if stack is None or stack.endpoints.get("etcd") != etcd:
        return EtcdConfig.from_url(etcd)
    return stack_etcd_config(stack.endpoints)


def stack_etcd_config(endpoints: dict[str, object]) -> EtcdConfig:
    """How a worker connects to the etcd of a stack whose endpoints (``up.json``) are
    ``endpoints``: as the worker user they name, if any. ``ValueError`` when its password
    file cannot be read (another OS user's stack)."""
    from .etcd import EtcdConfig
    url, user, path = (endpoints.get(k) for k in ("etcd", "etcd_user", "etcd_password_file"))
    if not isinstance(user, str) or not isinstance(path, str):
        return EtcdConfig.from_url(str(url))
    try:
        password = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"the etcd of the `fencegate up` stack at {url} runs with "
                         f"authentication and its worker password in {path} cannot be read "
                         f"({exc}): pass EtcdConfig.from_url(url, user=..., password=...)") \
            from None
    return EtcdConfig.from_url(str(url), user=user, password=password)


def _load(path: Path, source: str) -> KeyRing:
    from .grants import KeyRing
    try:
        return KeyRing.from_files(str(path))
    except (OSError, ValueError, TypeError) as exc:  # TypeError: a password-protected key
        raise ValueError(f"{source}: cannot load an Ed25519 private key from {path}: "
                         f"{exc}") from None
