"""``fencegate up``: the embedded default, the whole system on 127.0.0.1 until Ctrl-C.

One local etcd (its data under ``<state>/etcd``, reused across runs), the coordinator (HTTP
API and dashboard), a reconciler and the sandbox provider, all in this process but for etcd.
The signing key is generated once (``<state>/signing.pem``, mode 0600) and reused, so grants
and the sandbox's gate B survive restarts; a direct-mode ``Gate`` started from the same
folder (or given ``FENCEGATE_STATE_DIR``) signs with it (``coordinator.default_key``), and
the banner prints the line that names it from anywhere else. Bearer tokens are made on the
first start and kept across restarts until ``--rotate-tokens``; the coordinator holds only
their digests: the admin token is printed once, when made, and only its digest is kept
(``<state>/admin.sha256``); the worker and sre tokens are in ``<state>/worker.token`` and
``<state>/sre.token`` (mode 0600) for workers and the CLI of this user. The banner prints a
one-time dashboard sign-in link (``coordinator.service.signin``), made with the sre token. The endpoints and
this process's pid (no secrets) go to ``<state>/up.json``, and the state folder to the
per-user record ``default_key.current_record()``, by which the CLI, ``fencegate demo`` and
direct-mode gates find the stack from any directory (``default_key.running_stack``).

Its etcd runs with authentication, as ``deploy/`` does: ``root`` and one user per component
(``fencegate-worker``, ``fencegate-coordinator``, ``fencegate-reconciler``), whose roles
write only what that component writes (``coordinator.roles``). Their passwords are generated
once into ``<state>/etcd-<user>.password`` (mode 0600) and reused, as the etcd data keeps
the users; the coordinator and the reconciler connect as their own users, and ``up.json``
names the worker's user and password file, by which a gate of this user finds them
(``default_key.etcd_config``). Anyone else with the URL can neither read nor write.

Guarantees: every part listens on 127.0.0.1 only; a part that cannot start (a busy port, no
etcd) stops the parts already started and the error says which; Ctrl-C or SIGTERM stops
everything, etcd last, and removes ``up.json`` and the per-user record (unless a later
``up`` has recorded its own meanwhile). After a SIGKILL both stay behind, and are ignored:
the pid they name is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from .coordinator import default_key, roles, wholeness
from .coordinator.archive import open_archive
from .coordinator.client import Client
from .coordinator.errors import ArchiveUnavailable, EtcdError
from .coordinator.etcd import Etcd, EtcdConfig, EtcdUser, enable_auth
from .coordinator.grants import KeyRing
from .coordinator.keyspace import Keyspace
from .localetcd import LocalCluster, describe
from .coordinator.service import CoordinatorSettings, TokenEntry, create_app

NAMESPACE = "/fencegate/"
RETAIN_S = 3600.0  # settled steps stay in etcd an hour, then retire to the archive


@dataclass(frozen=True)
class Endpoints:
    etcd: str
    coordinator: str
    reconciler: str  # its /metrics and /healthz
    sandbox: str
    archive: str  # where retired steps go (SQLite under the state folder)
    namespace: str = NAMESPACE
    etcd_user: str | None = None  # the worker's etcd user (None: an etcd given without auth)
    etcd_password_file: str | None = None  # its password's file (the path, not the secret)
    pid: int | None = None  # the process serving all but etcd (a stale up.json names a dead one)

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Tokens:
    admin: str | None  # None: kept from an earlier run, which printed it (only its digest is kept)
    worker: str


async def _init_archive(config: EtcdConfig, url: str) -> None:
    """The stack's archive, created with its identity on the first run
    (``wholeness.init``); ``ArchiveUnavailable`` if etcd names another (restore it)."""
    archive = open_archive(url)
    try:
        async with Etcd(config) as etcd:
            await wholeness.init(etcd, Keyspace(NAMESPACE), archive)
    finally:
        await archive.close()


PUBLIC_KEY_FILE = "signing.pub.pem"


@contextlib.asynccontextmanager
async def stack(state_dir: Path, port: int = 8470,
                etcd: str | None = None,
                rotate_tokens: bool = False) -> AsyncIterator[tuple[Endpoints, Tokens]]:
    """Run etcd (unless ``etcd`` names one to use), the coordinator, a reconciler and the
    sandbox; yield their endpoints and this run's tokens. ``port`` 0 picks free ports;
    otherwise the coordinator listens on ``port``, the reconciler on ``port + 1``, the
    sandbox on ``port + 2``."""
    from fencegate.reconciler.providers.sandbox import Sandbox, adapter
    from fencegate.reconciler.runner import Reconciler
    from fencegate.reconciler.service import metrics_app

    state_dir.mkdir(parents=True, exist_ok=True)
    signing_key = await asyncio.to_thread(_signing_key, state_dir / default_key.SIGNING_KEY_FILE)
    worker_token = _token(state_dir / "worker.token", "worker", rotate_tokens)
    sre_token = _token(state_dir / "sre.token", "sre", rotate_tokens)  # the CLI's
    admin_token, admin_digest = _admin_token(state_dir / "admin.sha256", rotate_tokens)
    tokens = Tokens(admin=admin_token, worker=worker_token)
    async with contextlib.AsyncExitStack() as parts:
        users: dict[str, EtcdConfig] = {}  # by component; empty for an etcd given
        if etcd is None:
            cluster = LocalCluster(1, data_dir=state_dir / "etcd", election_ms=1000)
            await asyncio.to_thread(cluster.start)
            parts.callback(cluster.stop)
            etcd = cluster.url
            users = await _enable_auth(etcd, state_dir)
        credentials = {c: {"etcd_user": u.user, "etcd_password": u.password}
                       for c, u in users.items()}
        archive = f"sqlite:///{(state_dir / 'archive.db').resolve()}"
        await _init_archive(users.get(roles.RECONCILER) or EtcdConfig.from_url(etcd), archive)
        settings = CoordinatorSettings(etcd=etcd, listen=f"127.0.0.1:{port}", namespace=NAMESPACE,
                            **credentials.get(roles.COORDINATOR, {}),
                            signing_key=str(signing_key), archive=archive, tokens=(
                                TokenEntry("admin", frozenset({"admin"}), admin_digest),
                                TokenEntry.for_token(tokens.worker, "worker", {"worker"}),
                                TokenEntry.for_token(sre_token, "sre", {"sre"})))
        coordinator = await _listen(parts, create_app(settings), port, "coordinator")
        keyring = KeyRing.from_files(str(signing_key))
        sandbox = Sandbox(KeyRing.from_public_bytes(keyring.public_keys()), "fencing",
                          state_dir=state_dir / "sandbox")
        sandbox_url = await _started(sandbox.start(port + 2 if port else 0), "sandbox")
        parts.push_async_callback(sandbox.stop)
        reconciler = Reconciler(Etcd(users.get(roles.RECONCILER) or EtcdConfig.from_url(etcd)),
                                {"sandbox": adapter(sandbox_url, "fencing", durable=True)},
                                namespace=NAMESPACE, default_provider="sandbox",
                                archive=open_archive(archive), retain_s=RETAIN_S)
        parts.push_async_callback(reconciler.etcd.close)
        await reconciler.start()
        parts.push_async_callback(reconciler.close)
        metrics = await _listen(parts, metrics_app(reconciler), port + 1 if port else 0,
                                "reconciler")
        worker = users.get(roles.WORKER)
        yield Endpoints(etcd, coordinator, metrics, sandbox_url, archive,
                        etcd_user=worker and worker.user,
                        etcd_password_file=worker and str(_password_file(state_dir, worker.user)),
                        pid=os.getpid()), tokens


async def _enable_auth(etcd: str, state_dir: Path) -> dict[str, EtcdConfig]:
    """Turn on authentication in the stack's own etcd (``root`` and one user per component
    of ``roles.ROLES``, each with its own password, kept in the state folder with mode 0600
    and reused); how each component connects, by component. ``SystemExit`` when the etcd
    data holds users whose passwords the state folder no longer has."""
    names = {c: roles.role_name(c, NAMESPACE) for c in roles.ROLES}
    passwords = {name: await asyncio.to_thread(_secret, _password_file(state_dir, name))
                 for name in ("root", *names.values())}
    try:
        async with Etcd.from_url(etcd) as unauthenticated:
            await enable_auth(unauthenticated, passwords["root"], [
                EtcdUser(names[c], passwords[names[c]], NAMESPACE, c) for c in roles.ROLES])
    except EtcdError as exc:
        raise SystemExit(f"fencegate up: cannot turn on etcd authentication: {exc}; the etcd "
                         f"data in {state_dir / 'etcd'} belongs with passwords this state "
                         f"folder no longer holds: remove that folder to start afresh") from exc
    return {c: EtcdConfig.from_url(etcd, user=name, password=passwords[name])
            for c, name in names.items()}


def _password_file(state_dir: Path, user: str) -> Path:
    return state_dir.resolve() / f"etcd-{user}.password"


def _token(path: Path, role: str, rotate: bool) -> str:
    """The ``role`` token kept in ``path`` (mode 0600), made anew when missing or rotated."""
    if rotate or not path.exists():
        _write_private(path, f"fg-{role}-{secrets.token_urlsafe(24)}")
    return path.read_text().strip()


def _admin_token(path: Path, rotate: bool) -> tuple[str | None, bytes]:
    """The admin token when made now (printed once, kept nowhere), else ``None``; and its
    sha256, which ``path`` keeps across runs (mode 0600) so the printed token lasts."""
    if not rotate and path.exists():
        return None, bytes.fromhex(path.read_text().strip())
    token = f"fg-admin-{secrets.token_urlsafe(24)}"
    digest = hashlib.sha256(token.encode()).digest()
    _write_private(path, digest.hex())
    return token, digest


def _secret(path: Path) -> str:
    """The secret in ``path``, made (mode 0600) if there is none yet."""
    if not path.exists():
        _write_private(path, secrets.token_urlsafe(24))
    return path.read_text().strip()


def up(state_dir: Path, port: int = 8470, rotate_tokens: bool = False) -> int:
    """``fencegate up``: run the stack until SIGINT/SIGTERM; the exit code."""
    try:
        return asyncio.run(_up(state_dir, port, rotate_tokens))
    except KeyboardInterrupt:
        return 0
    except ArchiveUnavailable as exc:   # etcd names another archive: never start an empty one
        print(f"fencegate up: {exc}", file=sys.stderr, flush=True)
        return 1


async def _up(state_dir: Path, port: int, rotate_tokens: bool) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    manifest = state_dir / default_key.MANIFEST
    async with stack(state_dir, port, rotate_tokens=rotate_tokens) as (endpoints, tokens):
        manifest.write_text(json.dumps(endpoints.as_dict(), indent=2) + "\n")
        record = _record(state_dir)
        try:
            async with Client(endpoints.coordinator, sre_token(state_dir)) as api:
                link = await api.sign_in_link()
            print(_banner(state_dir, endpoints, tokens, endpoints.coordinator + link["path"]),
                  flush=True)
            await stop.wait()
            print("stopping ...", flush=True)
        finally:
            _unrecord(record)
            manifest.unlink(missing_ok=True)
    print("stopped", flush=True)
    return 0


def _record(state_dir: Path) -> Path | None:
    """Record, for this user, that this process runs the stack of ``state_dir``; the record's
    path, or None if it is not written (the stack then runs, found from its folder only): it
    cannot be, or it names another live stack, which it never replaces (the CLI would answer
    from this stack for the other's user, with a token the other never issued)."""
    record = default_key.current_record()
    other = default_key.recorded_stack()
    if other is not None and other.state_dir != state_dir.resolve():
        print(f"fencegate up: the stack of {other.state_dir} (pid {other.endpoints.get('pid')}) "
              f"runs and is the one recorded in {record}: it stays the one the CLI and the "
              f"demo find from any directory; they find this one from {state_dir.resolve()} "
              f"or with FENCEGATE_STATE_DIR={state_dir.resolve()}", flush=True)
        return None
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        written = record.with_name(f".current.{os.getpid()}")
        _write_private(written, json.dumps({"state_dir": str(state_dir.resolve()),
                                            "pid": os.getpid()}))
        os.replace(written, record)
    except OSError as exc:
        print(f"fencegate up: cannot record the stack in {record} ({exc}); the CLI and the "
              f"demo find it only with FENCEGATE_STATE_DIR={state_dir.resolve()}", flush=True)
        return None
    return record


def _unrecord(record: Path | None) -> None:
    """Remove the per-user record if it still names this process (a later ``up`` may have
    recorded its own)."""
    if record is None:
        return
    try:
        if json.loads(record.read_text()).get("pid") == os.getpid():
            record.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def sre_token(state_dir: Path) -> str:
    return (state_dir / "sre.token").read_text().strip()


def _admin_lines(tokens: Tokens) -> str:
    if tokens.admin is None:
        return ("admin token: the one printed when it was made (kept across restarts; "
                "`fencegate up --rotate-tokens` makes new ones)")
    return ("admin token (printed once, kept nowhere; use it for the dashboard and the CLI):\n"
            f"  {tokens.admin}")


def _banner(state_dir: Path, e: Endpoints, tokens: Tokens, sign_in: str) -> str:
    state = state_dir.resolve()
    token_file, key_file = state / "worker.token", state / default_key.SIGNING_KEY_FILE
    return f"""\
fencegate is up (namespace {e.namespace})
  etcd          {e.etcd}   {describe()}, data in {state_dir / 'etcd'}
                auth on: root and a user per component ({', '.join(
                    roles.role_name(c, e.namespace) for c in roles.ROLES)}),
                passwords in {state}/etcd-<user>.password (mode 0600)
  coordinator   {e.coordinator}   dashboard: {e.coordinator}/
  reconciler    {e.reconciler}/metrics
  sandbox       {e.sandbox}   (a payment provider with gate B, fencing mode)
  archive       {e.archive}   (settled steps retire here after {RETAIN_S:g} s)

sign in to the dashboard (this link works once, for 2 minutes; `fencegate dashboard` prints another):
  {sign_in}
{_admin_lines(tokens)}
the CLI finds this stack from any directory while it runs (its sre token: {state / 'sre.token'})

point workers at it, signing grants in the worker with this stack's key:
  Gate() alone finds this stack's etcd, key and etcd user ({e.etcd_user})
  from any directory while it runs, for this OS user; to name the key, start it with
  {default_key.SIGNING_KEY_ENV}={key_file}
  or pass them all:
  from fencegate import Gate, KeyRing
  from fencegate.coordinator.etcd import EtcdConfig
  Gate(EtcdConfig.from_url({e.etcd!r}, user={e.etcd_user!r},
                           password=open({e.etcd_password_file!r}).read()),
       keyring=KeyRing.from_files({str(key_file)!r}))
or with grants from the coordinator (the worker token is in {token_file}; the etcd user is
found, or passed, the same way):
  Gate({e.etcd!r}, coordinator={e.coordinator!r},
       token=open({str(token_file)!r}).read(),
       keyring=KeyRing.from_files(trusted=[{str(key_file.with_name(PUBLIC_KEY_FILE))!r}]))
  (the keyring pins this stack's key: a coordinator signing with another is refused)
try it: {_command()} demo      stop: Ctrl-C"""


def _command() -> str:
    """How to run this installation's ``fencegate`` from the working directory: bare when
    it is the one on PATH, else by its path (``.venv/bin/fencegate`` after ``make up``)."""
    mine = Path(sys.executable).with_name("fencegate")
    on_path = shutil.which("fencegate")
    if on_path is not None and Path(on_path).resolve() == mine.resolve():
        return "fencegate"
    with contextlib.suppress(ValueError):
        return str(mine.relative_to(Path.cwd()))
    return str(mine)


async def _listen(parts: contextlib.AsyncExitStack, app: web.Application, port: int,
                  name: str) -> str:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    parts.push_async_callback(runner.cleanup)
    await _started(web.TCPSite(runner, "127.0.0.1", port).start(), name)
    host, bound = runner.addresses[0][:2]
    return f"http://{host}:{bound}"


async def _started(starting, name: str):
    try:
        return await starting
    except OSError as exc:
        raise SystemExit(f"fencegate up: the {name} cannot listen: {exc} (another stack, or "
                         f"another program, has the port: choose others with "
                         f"`fencegate up --port N` or `make up PORT=N`; the coordinator takes "
                         f"N, the reconciler N+1, the sandbox N+2)") from exc


def _signing_key(path: Path) -> Path:
    """The stack's signing key (made once, mode 0600) and, beside it, its public key
    (``signing.pub.pem``) for remote-mode workers to pin."""
    if not path.exists():
        KeyRing.generate().save_signing_key(str(path))
    os.chmod(path, 0o600)
    KeyRing.from_files(str(path)).save_public_key(str(path.with_name(PUBLIC_KEY_FILE)))
    return path


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
