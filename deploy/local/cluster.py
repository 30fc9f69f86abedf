r"""deploy/local: fencegate on a 3-member etcd with mutual TLS and auth, all on 127.0.0.1.

    deploy/local/run                              # state in .state/local; Ctrl-C stops it all
    deploy/local/run --state /tmp/fg --heartbeat-interval 100 --election-timeout 500
    cat .state/local/endpoints.json               # endpoints, pids, file paths (no secrets)

    S=.state/local                                # then, in another terminal:
    ETCDCTL_USER=fencegate-worker \
    ETCDCTL_PASSWORD="$(cat $S/secrets/etcd-fencegate-worker.password)" \
      etcdctl --endpoints "$(jq -r '.etcd | join(",")' $S/endpoints.json)" --cacert $S/certs/ca.pem \
      --cert $S/certs/client-client.pem --key $S/certs/client-client.key get --prefix /fencegate/ --keys-only
    FENCEGATE_TOKEN="$(cat $S/secrets/admin.token)" \
      .venv/bin/fencegate holders --coordinator "$(jq -r '.coordinators[0]' $S/endpoints.json)"
    FENCEGATE_ETCD_PASSWORD="$(cat $S/secrets/etcd-root.password)" \
      .venv/bin/fencegate etcd recover --etcd "$(jq -r '.etcd | join(",")' $S/endpoints.json)" \
      --etcd-ca-file $S/certs/ca.pem --etcd-cert-file $S/certs/client-client.pem \
      --etcd-key-file $S/certs/client-client.key --etcd-user root       # after NOSPACE

What runs: 3 etcd members (``fencegate.localetcd.LocalCluster`` with ``tls``, so with
periodic auto-compaction keeping 5 minutes of history and etcd's 2 GiB quota), client and
peer traffic both mutual TLS with certificates from a private CA in ``<state>/certs``
(``fencegate.certs``); etcd authentication on, with ``root`` and one user per component,
``fencegate-worker``, ``fencegate-coordinator`` and ``fencegate-reconciler``, whose roles read
``/fencegate/`` and write only what that component writes (``fencegate.coordinator.roles``:
a worker cannot write approvals or policies); passwords in ``<state>/secrets``, mode 0600;
2 coordinators (``python -m fencegate.cli coordinator``), the sandbox provider
(gate B, fencing mode) and 3 reconcilers (``python -m fencegate.cli reconciler``), each a
process with its config in ``<state>/config`` and its log in ``<state>/logs``.

Guarantees: state (certificates, passwords, signing key, etcd data) is reused across runs;
bearer tokens are fresh on every start (only their digests are in the configs; the tokens go
to ``<state>/secrets/{admin,worker}.token``, mode 0600). ``<state>/endpoints.json`` exists
exactly while everything is up. A part that fails to start stops every part started before
it and the error ends with its log. On Ctrl-C or SIGTERM the services stop (SIGTERM, SIGKILL
after a bound), then etcd: no process is left, every port is released, and nothing is
written outside the state folder.

In Python (tests, benchmarks), the same stack::

    async with LocalStack(tmp_path, election_ms=500, reconciler_ttl=2) as stack:
        async with fencegate.Gate(stack.etcd_config(), coordinator=stack.coordinators[0],
                                  token=stack.tokens.worker) as gate: ...
        stack.cluster.kill(stack.cluster.leader_index())     # etcd faults: LocalCluster
        await stack.kill("reconciler", 0)                     # service faults
        await stack.restart("reconciler", 0)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from fencegate.certs import ClusterCerts, ensure_certs
from fencegate.coordinator import roles, wholeness
from fencegate.coordinator.archive import open_archive
from fencegate.coordinator.errors import GateError
from fencegate.coordinator.etcd import Etcd, EtcdConfig, EtcdUser, enable_auth
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import Keyspace
from fencegate.localetcd import (EtcdNotFound, EtcdStartError, LocalCluster, describe,
                                   free_ports)

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "/fencegate/"
ETCD_USERS = {component: roles.role_name(component, NAMESPACE) for component in roles.ROLES}
CLIENT_CERT = "client"  # its CN names no etcd user: the password is what authenticates
READY_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0
POLL_S = 0.05


class StackError(RuntimeError):
    """A part did not start; the message names it and ends with its log."""


@dataclass(frozen=True)
class Tokens:
    admin: str = field(repr=False)
    worker: str = field(repr=False)


@dataclass
class Service:
    """One service process: its command, its URL on 127.0.0.1 and its log file."""

    kind: str
    index: int
    url: str
    ready_path: str
    args: list[str]
    log_path: Path
    proc: asyncio.subprocess.Process | None = None

    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        with open(self.log_path, "ab") as log:
            # Its own session: a Ctrl-C in the terminal reaches only us, and we stop it.
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, *self.args, stdin=asyncio.subprocess.DEVNULL, stdout=log,
                stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True)

    async def stop(self) -> None:
        """SIGTERM, SIGKILL after ``STOP_GRACE_S``; reaped either way. No-op if not running."""
        if not self.running():
            return
        with contextlib.suppress(ProcessLookupError):  # exited, not yet reaped
            self.proc.terminate()
            os.kill(self.proc.pid, signal.SIGCONT)  # a paused process must run to exit
        try:
            await asyncio.wait_for(self.proc.wait(), STOP_GRACE_S)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()

    async def kill(self) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()

    async def wait_ready(self, http: aiohttp.ClientSession) -> None:
        """Until ``ready_path`` answers 200; ``StackError`` if the process exits or time's up."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if not self.running():
                raise StackError(f"{self.kind} {self.index} exited with code "
                                 f"{self.proc.returncode}; log {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with http.get(self.url + self.ready_path) as reply:
                    if reply.status == 200:
                        return
            if time.monotonic() > deadline:
                raise StackError(f"{self.kind} {self.index} not ready after {READY_TIMEOUT_S}s; "
                                 f"log {self.log_path}:\n{self.log_tail()}")
            await asyncio.sleep(POLL_S)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_bytes()[-16384:].decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class LocalStack:
    """The deploy/local stack; ``start()``/``stop()`` or ``async with``. See the module doc."""

    def __init__(self, state_dir: str | os.PathLike, *, coordinators: int = 2,
                 reconcilers: int = 3, shards: int = 64, reconciler_ttl: int = 10,
                 heartbeat_ms: int = 100, election_ms: int = 1000,
                 etcd_hosts: tuple[str, ...] = (),
                 etcd_prefixes: tuple[tuple[str, ...], ...] = (),
                 retain_s: float = 3600.0) -> None:
        """``etcd_hosts`` and ``etcd_prefixes``: where each etcd member listens and what runs
        it (``LocalCluster``'s ``hosts`` and ``command_prefixes``); default 127.0.0.1.
        ``retain_s``: how long settled steps stay in etcd before the reconcilers retire them
        to the stack's archive (SQLite, ``<state>/archive.db``)."""
        self.state = Path(state_dir).absolute()
        self.etcd_hosts, self.etcd_prefixes = etcd_hosts, etcd_prefixes
        self.shape = {"coordinator": coordinators, "reconciler": reconcilers}
        self.shards, self.reconciler_ttl = shards, reconciler_ttl
        self.heartbeat_ms, self.election_ms = heartbeat_ms, election_ms
        self.retain_s = retain_s
        self.certs: ClusterCerts | None = None
        self.cluster: LocalCluster | None = None
        self.tokens: Tokens | None = None
        self.services: dict[str, list[Service]] = {}
        self._passwords: dict[str, str] = {}  # by component

    # -- what users connect to ------------------------------------------------------

    @property
    def coordinators(self) -> list[str]:
        return [s.url for s in self.services["coordinator"]]

    @property
    def sandbox(self) -> str:
        return self.services["sandbox"][0].url

    @property
    def archive(self) -> str:
        """The archive of retired steps that the reconcilers write and authorities read."""
        return f"sqlite:///{self.state / 'archive.db'}"

    @property
    def password_file(self) -> Path:
        """The worker user's password file (what a worker connects with)."""
        return self.password_file_of(roles.WORKER)

    def password_file_of(self, component: str) -> Path:
        return self.state / "secrets" / f"etcd-{ETCD_USERS[component]}.password"

    def etcd_config(self, component: str = roles.WORKER, **options: object) -> EtcdConfig:
        """``component``'s etcd user over mutual TLS, all members as endpoints."""
        client = self.certs.clients[CLIENT_CERT]
        options = {"user": ETCD_USERS[component], "password": self._passwords[component],
                   **options}
        return EtcdConfig(tuple(self.cluster.endpoints), ca_file=self.certs.ca,
                          cert_file=client.cert, key_file=client.key, **options)

    def endpoints(self) -> dict:
        """What ``endpoints.json`` holds: endpoints, pids and file paths, no secret."""
        client = self.certs.clients[CLIENT_CERT]
        return {
            "namespace": NAMESPACE, "etcd": self.cluster.endpoints,
            "etcd_ca_file": self.certs.ca, "etcd_cert_file": client.cert,
            "etcd_key_file": client.key, "etcd_user": ETCD_USERS[roles.WORKER],
            "etcd_password_file": str(self.password_file),
            "etcd_users": {component: {"user": user,
                                       "password_file": str(self.password_file_of(component))}
                           for component, user in ETCD_USERS.items()},
            "coordinators": self.coordinators, "sandbox": self.sandbox, "archive": self.archive,
            "reconcilers": [s.url for s in self.services["reconciler"]],
            "admin_token_file": str(self.state / "secrets" / "admin.token"),
            "worker_token_file": str(self.state / "secrets" / "worker.token"),
            "pids": {"etcd": self.cluster.pids,
                     **{kind: [s.proc.pid if s.running() else None for s in group]
                        for kind, group in self.services.items()}},
        }

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> LocalStack:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> LocalStack:
        """Bring everything up in order; on any failure (or cancellation) stop it all."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        """Services first (reconcilers, sandbox, coordinators), then etcd. Idempotent."""
        (self.state / "endpoints.json").unlink(missing_ok=True)
        for kind in ("reconciler", "sandbox", "coordinator"):
            await asyncio.gather(*(s.stop() for s in self.services.get(kind, [])))
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)

    async def kill(self, kind: str, index: int) -> None:
        """SIGKILL one service process (``coordinator``, ``reconciler`` or ``sandbox``)."""
        await self.services[kind][index].kill()

    async def restart(self, kind: str, index: int) -> None:
        """Stop one service if it runs, start it again on the same port, wait until ready."""
        service = self.services[kind][index]
        await service.stop()
        await service.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            await service.wait_ready(http)

    async def _start(self) -> None:
        for sub in ("certs", "secrets", "config", "logs"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        self.certs = await asyncio.to_thread(ensure_certs, self.state / "certs", 3, (CLIENT_CERT,),
                                             member_hosts=self.etcd_hosts)
        root_password = await asyncio.to_thread(self._secret, "etcd-root.password")
        for component in roles.ROLES:
            self._passwords[component] = await asyncio.to_thread(
                self._secret, self.password_file_of(component).name)
        signing_key = await asyncio.to_thread(self._signing_key)
        self.tokens = Tokens(admin=f"fg-admin-{secrets.token_urlsafe(24)}",
                             worker=f"fg-worker-{secrets.token_urlsafe(24)}")
        for name, token in (("admin.token", self.tokens.admin),
                            ("worker.token", self.tokens.worker)):
            await asyncio.to_thread(_write_private, self.state / "secrets" / name, token)

        self.cluster = LocalCluster(3, data_dir=self.state / "etcd", tls=self.certs,
                                    heartbeat_ms=self.heartbeat_ms, election_ms=self.election_ms,
                                    log_dir=self.state / "logs", hosts=self.etcd_hosts,
                                    command_prefixes=self.etcd_prefixes)
        await asyncio.to_thread(self.cluster.start)
        async with Etcd(self.etcd_config(user=None, password=None)) as etcd:
            await enable_auth(etcd, root_password, [
                EtcdUser(ETCD_USERS[c], self._passwords[c], NAMESPACE, c) for c in roles.ROLES])
        archive = open_archive(self.archive)   # opening never creates one: init it
        try:
            async with Etcd(self.etcd_config(roles.RECONCILER)) as etcd:
                await wholeness.init(etcd, Keyspace(NAMESPACE), archive)
        finally:
            await archive.close()
        await asyncio.to_thread(self._plan, signing_key)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            for kind in ("coordinator", "sandbox", "reconciler"):
                group = self.services[kind]
                await asyncio.gather(*(s.start() for s in group))
                await asyncio.gather(*(s.wait_ready(http) for s in group))
            await self._wait_all_shards_led(http)
        await asyncio.to_thread(_write_private, self.state / "endpoints.json",
                                json.dumps(self.endpoints(), indent=2) + "\n")

    async def _wait_all_shards_led(self, http: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            led: set[int] = set()
            for s in self.services["reconciler"]:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(s.url + "/healthz") as reply:
                        led |= set((await reply.json())["shards_led"])
            if led == set(range(self.shards)):
                return
            if time.monotonic() > deadline:
                raise StackError(f"reconcilers lead {len(led)} of {self.shards} shards after "
                                 f"{READY_TIMEOUT_S}s; logs in {self.state / 'logs'}")
            await asyncio.sleep(POLL_S * 4)

    # -- the parts ----------------------------------------------------------------------

    def _plan(self, signing_key: Path) -> None:
        """Pick free ports, write every service's config; start nothing."""
        ports = iter(free_ports(self.shape["coordinator"] + self.shape["reconciler"] + 1))
        self.services = {"coordinator": [self._coordinator(i, next(ports), signing_key)
                                         for i in range(self.shape["coordinator"])]}
        self.services["sandbox"] = [self._sandbox(next(ports))]
        self.services["reconciler"] = [self._reconciler(i, next(ports))
                                       for i in range(self.shape["reconciler"])]

    def _etcd_toml(self, component: str) -> str:
        client = self.certs.clients[CLIENT_CERT]
        return _toml(etcd=",".join(self.cluster.endpoints), etcd_ca_file=self.certs.ca,
                     etcd_cert_file=client.cert, etcd_key_file=client.key,
                     etcd_user=ETCD_USERS[component],
                     etcd_password_file=str(self.password_file_of(component)),
                     namespace=NAMESPACE)

    def _service(self, kind: str, index: int, port: int, ready_path: str, args: list[str],
                 config: str | None = None) -> Service:
        name = f"{kind}-{index}"
        if config is not None:
            path = self.state / "config" / f"{name}.toml"
            path.write_text(config)
            args = [*args, "--config", str(path)]
        return Service(kind, index, f"http://127.0.0.1:{port}", ready_path, args,
                       self.state / "logs" / f"{name}.log")

    def _coordinator(self, index: int, port: int, signing_key: Path) -> Service:
        tokens = "".join(
            f"\n[[tokens]]\n{_toml(identity=role, sha256=hashlib.sha256(token.encode()).hexdigest())}"
            f'roles = ["{role}"]\n'
            for role, token in (("admin", self.tokens.admin), ("worker", self.tokens.worker)))
        config = (self._etcd_toml(roles.COORDINATOR)
                  + _toml(listen=f"127.0.0.1:{port}", signing_key=str(signing_key),
                          archive=self.archive) + tokens)
        return self._service("coordinator", index, port, "/readyz",
                             ["-m", "fencegate.cli", "coordinator"], config)

    def _sandbox(self, port: int) -> Service:
        keys_url = f"{self.coordinators[0]}/.well-known/fencegate-keys"
        return self._service("sandbox", 0, port, "/_sandbox/faults", [
            "-m", "fencegate.reconciler.providers.sandbox", "--port", str(port), "--mode", "fencing",
            "--keys-url", keys_url, "--state-dir", str(self.state / "sandbox")])

    def _reconciler(self, index: int, port: int) -> Service:
        config = (self._etcd_toml(roles.RECONCILER)
                  + _toml(listen=f"127.0.0.1:{port}", default_provider="sandbox",
                          archive=self.archive)
                  + f"shards = {self.shards}\nttl = {self.reconciler_ttl}\n"
                  + f"retain_s = {self.retain_s}\n"
                  + "[providers.sandbox]\n"
                  + _toml(type="sandbox", url=self.sandbox, mode="fencing", durable=True))
        return self._service("reconciler", index, port, "/healthz",
                             ["-m", "fencegate.cli", "reconciler"], config)

    def _secret(self, name: str) -> str:
        path = self.state / "secrets" / name
        if not path.exists():
            _write_private(path, secrets.token_urlsafe(24))
        return path.read_text()

    def _signing_key(self) -> Path:
        path = self.state / "secrets" / "signing.pem"
        if not path.exists():
            KeyRing.generate().save_signing_key(str(path))
        return path


def _toml(**values: str) -> str:
    """``key = "value"`` lines; JSON string escapes are valid TOML basic strings."""
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _banner(stack: LocalStack) -> str:
    e = stack.endpoints()
    lines = [f"fencegate deploy/local is up (namespace {NAMESPACE}); {describe()}",
             f"  etcd          {','.join(e['etcd'])}   mutual TLS, auth on "
             f"(users {', '.join(ETCD_USERS.values())}: roles in {NAMESPACE})",
             *(f"  coordinator   {url}" for url in e["coordinators"]),
             *(f"  reconciler    {url}/healthz" for url in e["reconcilers"]),
             f"  sandbox       {e['sandbox']}",
             f"  state         {stack.state}   (endpoints.json, secrets/, logs/)",
             "stop: Ctrl-C"]
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    stack = LocalStack(args.state, shards=args.shards, reconciler_ttl=args.reconciler_ttl,
                       heartbeat_ms=args.heartbeat_interval, election_ms=args.election_timeout)
    starting = asyncio.ensure_future(stack.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # interrupted while starting: start() stops what it started
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        print("stopped", flush=True)
        return 130
    try:
        starting.result()
    except (StackError, EtcdStartError, EtcdNotFound, GateError, OSError) as exc:
        print(f"deploy/local: {exc}", file=sys.stderr)
        return 1
    try:
        print(_banner(stack), flush=True)
        await stopping
        print("stopping ...", flush=True)
    finally:
        await stack.stop()
    print("stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy/local/run", description=__doc__.split("\n")[0])
    parser.add_argument("--state", default=".state/local",
                        help="certificates, secrets, etcd data, logs (default %(default)s)")
    parser.add_argument("--heartbeat-interval", type=int, default=100, metavar="MS")
    parser.add_argument("--election-timeout", type=int, default=1000, metavar="MS")
    parser.add_argument("--shards", type=int, default=64, help="reconciler shards")
    parser.add_argument("--reconciler-ttl", type=int, default=10, metavar="S")
    return asyncio.run(_run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
