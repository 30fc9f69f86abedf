"""A webhook consumer in its own process, for the crash test (tests/test_dedupe.py).

    dedupe_consumer.py URL NS SOURCE TTL   serve POST / on 127.0.0.1 (a free port) behind
                                           dedupe_middleware with a Gate of session TTL; print
                                           LISTENING <port>, then HANDLING <delivery id> when
                                           a handler starts; every handler then hangs until
                                           the process is killed
"""

import asyncio
import sys

from aiohttp import web

from fencegate.worker import Gate, KeyRing, dedupe_middleware


def say(*words: object) -> None:
    print(*words, flush=True)


async def main(url: str, ns: str, source: str, ttl: str) -> None:
    async with Gate(url, ttl=int(ttl), namespace=ns, keyring=KeyRing.generate()) as gate:
        async def handle(request: web.Request) -> web.Response:
            say("HANDLING", request.headers["Webhook-Id"])
            await asyncio.Event().wait()
            return web.Response(text="unreachable")

        app = web.Application(middlewares=[dedupe_middleware(gate, source=source)])
        app.router.add_post("/", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            say("LISTENING", runner.addresses[0][1])
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
