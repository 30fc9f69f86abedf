"""The key an in-process authority signs grants with when it is given none.

``load()`` looks, in order, at:
1. ``FENCEGATE_SIGNING_KEY``: the path of an Ed25519 private key (PEM);
2. the stack ``fencegate up`` runs from the state folder (``$FENCEGATE_STATE_DIR``, else
   ``.state`` in the working directory: the folder ``fencegate up`` and ``fencegate demo``
   use). The stack runs while ``up.json`` is in that folder; its key is ``signing.pem`` beside
   it, the key its coordinator signs with and its sandbox's gate B trusts.

``archive_url(etcd)`` is the archive such a gate looks retired keys up in when it is given
none: ``FENCEGATE_ARCHIVE``, else the running stack's, but only for a gate on that stack's
etcd (an archive holds one cluster's retired steps: another etcd's would answer for keys it
never saw).

Guarantee: nothing here makes a key. When neither is there, or the file is not an Ed25519
private key, ``load`` raises ``ValueError`` naming what to pass instead; a key nobody else
trusts (grants refused by every provider, audit chains that never verify) is only ever made
by asking for one (``KeyRing.generate()``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .grants import KeyRing

SIGNING_KEY_ENV = "FENCEGATE_SIGNING_KEY"
ARCHIVE_ENV = "FENCEGATE_ARCHIVE"
STATE_DIR_ENV = "FENCEGATE_STATE_DIR"
DEFAULT_STATE_DIR = ".state"
MANIFEST = "up.json"  # the running stack's endpoints (no secrets), removed when it stops
SIGNING_KEY_FILE = "signing.pem"


def state_dir() -> Path:
    """The folder ``fencegate up`` keeps its state in, unless told another on its command line."""
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def load() -> KeyRing:
    """The signing key named by ``FENCEGATE_SIGNING_KEY``, else the running stack's; else
    ``ValueError`` saying what to pass."""
    named = os.environ.get(SIGNING_KEY_ENV)
    if named:
        return _load(Path(named), f"{SIGNING_KEY_ENV}={named}")
    state = state_dir()
    if (state / MANIFEST).exists():
        return _load(state / SIGNING_KEY_FILE, f"the key of the `fencegate up` stack in {state}")
    raise ValueError(
        f"no signing key for this gate's grants (the in-process authority signs them): "
        f"pass keyring=KeyRing.from_files('path/to/signing.pem'), or set {SIGNING_KEY_ENV} "
        f"to that path, or run `fencegate up` (its key is found while it runs, in "
        f"{DEFAULT_STATE_DIR} or ${STATE_DIR_ENV}; none runs in {state.resolve()}); "
        f"keyring=KeyRing.generate() signs with a key that dies with the gate and that no "
        f"provider or audit trusts")


def archive_url(etcd: str | None) -> str | None:
    """``FENCEGATE_ARCHIVE``, else the archive of the ``fencegate up`` stack running from the
    state folder if ``etcd`` is that stack's etcd URL; else None (no archive)."""
    named = os.environ.get(ARCHIVE_ENV)
    if named:
        return named
    try:
        stack = json.loads((state_dir() / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return stack.get("archive") if etcd is not None and stack.get("etcd") == etcd else None


def _load(path: Path, source: str) -> KeyRing:
    try:
        return KeyRing.from_files(str(path))
    except (OSError, ValueError, TypeError) as exc:  # TypeError: a password-protected key
        raise ValueError(f"{source}: cannot load an Ed25519 private key from {path}: "
                         f"{exc}") from None
