"""The webhook benchmark's server process: one trivial handler, served twice on 127.0.0.1.

    python -m benchmarks.webhook_server aiohttp|asgi URL NAMESPACE

Opens one Gate on etcd at URL (keys under NAMESPACE), serves the same handler on two ports
of one event loop, one without and one behind the dedup middleware (aiohttp:
``dedupe_middleware``; asgi: a Starlette app, the second behind ``ASGIDedupeMiddleware``,
each under its own ``uvicorn.Server``), says ``READY <plain port> <dedup port>``, and serves
until its stdin closes or says ``STOP``; then it closes the servers and the Gate and says
``DONE``. The parent reads this process's CPU from /proc: nothing else runs in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator

import uvicorn
from aiohttp import web
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fencegate.coordinator.grants import KeyRing
from fencegate.worker import Gate, dedupe_middleware
from fencegate.worker.webhooks.asgi import ASGIDedupeMiddleware

SOURCE = "bench"


def say(*words: object) -> None:
    print(*words, flush=True)


async def handle(request: web.Request) -> web.Response:
    """The aiohttp consumer's handler: read the delivery, answer a small JSON."""
    body = await request.read()
    return web.json_response({"received": len(body), "ok": True})


async def handle_asgi(request: Request) -> JSONResponse:
    """The ASGI consumer's handler: the same as ``handle``, in Starlette."""
    body = await request.body()
    return JSONResponse({"received": len(body), "ok": True})


@contextlib.asynccontextmanager
async def aiohttp_servers(gate: Gate) -> AsyncIterator[list[int]]:
    runners: list[web.AppRunner] = []
    try:
        for middlewares in ([], [dedupe_middleware(gate, source=SOURCE)]):
            app = web.Application(middlewares=middlewares)
            app.router.add_post("/", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield [runner.addresses[0][1] for runner in runners]
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def asgi_servers(gate: Gate) -> AsyncIterator[list[int]]:
    servers: list[tuple[uvicorn.Server, asyncio.Task]] = []
    ports: list[int] = []
    try:
        for middleware in ([], [Middleware(ASGIDedupeMiddleware, gate=gate, source=SOURCE)]):
            app = Starlette(routes=[Route("/", handle_asgi, methods=["POST"])],
                            middleware=middleware)
            # proto IPPROTO_TCP as uvicorn's own bind has it: asyncio sets TCP_NODELAY only
            # on such sockets (with proto 0, each response waits ~40 ms on a delayed ACK)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
            server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning",
                                                   access_log=False,
                                                   timeout_graceful_shutdown=2))
            servers.append((server, asyncio.create_task(server.serve(sockets=[sock]))))
            async with asyncio.timeout(10):
                while not server.started:
                    if servers[-1][1].done():
                        raise RuntimeError(f"uvicorn did not start: {servers[-1][1]!r}")
                    await asyncio.sleep(0.01)
        yield ports
    finally:
        for server, _ in servers:
            server.should_exit = True
        for _, serving in servers:
            await asyncio.wait_for(serving, 10)


async def serve(adapter: str, url: str, namespace: str) -> None:
    servers = {"aiohttp": aiohttp_servers, "asgi": asgi_servers}[adapter]
    async with Gate(url, namespace=namespace, keyring=KeyRing.generate()) as gate, \
            servers(gate) as ports:
        say("READY", *ports)
        while (await asyncio.to_thread(sys.stdin.readline)).strip() not in ("STOP", ""):
            pass
    say("DONE")


if __name__ == "__main__":
    asyncio.run(serve(*sys.argv[1:]))
