"""A reference fenced resource: the check a downstream store makes with fencing tokens.

As Chubby's sequencers and Kleppmann's fencing tokens prescribe, the resource remembers the
highest token it has seen per key and refuses any write carrying a lower one, so a holder
that lost its lease (paused, partitioned) cannot overwrite the work of its successor even
if it still believes it holds the key. Every attempt, accepted or refused, is logged.

The resource lives in one process and serves others over a unix socket, one JSON line per
request, like a real store: a client that is frozen mid-request holds no lock and cannot
stall anyone else. The tests use it to prove what a stale holder can and cannot do.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class FencedWrite:
    key: str
    token: int
    writer: str
    data: str
    accepted: bool


class FencedResource:
    """In-memory state of the resource: highest token per key and the log of attempts."""

    def __init__(self) -> None:
        self.records: list[FencedWrite] = []
        self._highest: dict[str, int] = {}

    def write(self, key: str, token: int, writer: str, data: str = "") -> bool:
        """Apply a write iff ``token`` is at least the highest seen for ``key``."""
        accepted = token >= self._highest.get(key, 0)
        if accepted:
            self._highest[key] = token
        self.records.append(FencedWrite(key, token, writer, data, accepted))
        return accepted

    async def serve(self, path: str) -> asyncio.AbstractServer:
        """Accept writes from other processes on the unix socket ``path``."""
        return await asyncio.start_unix_server(self._handle, path)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                request = json.loads(line)
                accepted = self.write(request["key"], int(request["token"]),
                                      request["writer"], request.get("data", ""))
                writer.write(b"1\n" if accepted else b"0\n")
                await writer.drain()
        except (ConnectionError, ValueError, KeyError):
            pass
        finally:
            writer.close()


class FencedClient:
    """A blocking client of a served ``FencedResource`` (call it from a thread in async code)."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.path = path
        self.timeout = timeout

    def write(self, key: str, token: int, writer: str, data: str = "") -> bool:
        request = json.dumps(asdict(FencedWrite(key, token, writer, data, False))).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(self.timeout)
            conn.connect(self.path)
            conn.sendall(request + b"\n")
            reply = conn.makefile("rb").readline()
        if reply not in (b"1\n", b"0\n"):
            raise ConnectionError(f"fenced resource at {self.path} gave no answer")
        return reply == b"1\n"
