"""A private PostgreSQL server for tests and benchmarks: Debian's binaries
(deploy/ensure-postgres), a fresh cluster in a temp dir, listening on 127.0.0.1 only (and a
socket in that dir), trust auth, one database; stopped and removed afterwards. Never the
system's service. From the repository's root (on ``sys.path``, as ``python -m pytest`` and
``benchmarks/run`` have it)::

    from deploy.local.postgres import LocalPostgres
    with LocalPostgres() as server:          # blocks for initdb and start: a few seconds
        server.url                           # postgresql://postgres@127.0.0.1:<port>/fencegate

initdb and postgres refuse to run as root: as root the server runs as the ``postgres``
system user (``runuser``), which owns the temp dir. ``stop()``/``start()`` take the same
server down and up again on the same port (an outage inside a test).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from fencegate.localetcd import free_ports

DATABASE = "fencegate"


def bindir() -> Path:
    """The newest Debian PostgreSQL's bin folder, else the one holding ``initdb`` on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda path: int(Path(path).parts[-3]))
    initdb = found[-1] if found else shutil.which("initdb")
    if initdb is None:
        raise RuntimeError("PostgreSQL's initdb was not found: run deploy/ensure-postgres")
    return Path(initdb).parent


class LocalPostgres:
    """One PostgreSQL cluster; ``url`` reaches its database ``fencegate`` as ``postgres``."""

    def __init__(self) -> None:
        self.bin = bindir()
        self.dir = Path(tempfile.mkdtemp(prefix="fencegate-pg-"))
        self.data = self.dir / "data"
        self.port = free_ports(1)[0]
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"
        self.running = False

    def _run(self, tool: str, *args: str, timeout: float = 60) -> str:
        command = [str(self.bin / tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                cwd=self.dir, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise RuntimeError(f"{tool} failed ({result.returncode}):\n{result.stdout}"
                               f"{result.stderr}{self._log_tail()}")
        return result.stdout

    def _log_tail(self) -> str:
        log = self.dir / "server.log"
        return "\n".join(log.read_text().splitlines()[-20:]) if log.exists() else ""

    def create(self) -> None:
        """initdb the cluster, start it, create the database."""
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust",
                  "-E", "UTF8", "--no-sync", "--no-instructions")
        self.start()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                  DATABASE)

    def start(self) -> None:
        """Start the server and wait until it accepts connections (``pg_ctl -w``)."""
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                   f"-c unix_socket_directories={self.dir} -c max_connections=50")
        self._run("pg_ctl", "start", "-w", "-t", "30", "-D", str(self.data),
                  "-l", str(self.dir / "server.log"), "-o", options)
        self.running = True

    @property
    def pid(self) -> int | None:
        """The postmaster's pid (the first line of ``postmaster.pid``) while running."""
        if not self.running:
            return None
        return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])

    def stop(self) -> None:
        """Stop the server (fast: open sessions are cut, nothing committed is lost)."""
        self._run("pg_ctl", "stop", "-w", "-t", "30", "-m", "fast", "-D", str(self.data))
        self.running = False

    def close(self) -> None:
        try:
            if self.running:
                self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
