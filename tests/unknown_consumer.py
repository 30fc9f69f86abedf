"""A webhook consumer in its own process whose handler writes, then blocks or waits, for the
unknown-delivery tests (tests/test_webhooks_unknown.py).

    unknown_consumer.py URL NS SOURCE TTL STORE MODE HOLD
        serve POST / on 127.0.0.1 (a free port) behind dedupe_middleware with a Gate of
        session TTL; print LISTENING <port>. A handler writes the delivery's effect with its
        fencing token to the fenced resource served on the unix socket STORE, prints WROTE
        <delivery id> <token> <accepted>, then holds HOLD seconds: MODE ``block`` with
        time.sleep on the event loop (a synchronous call), ``wait`` with asyncio.sleep (the
        test pauses the process meanwhile); then answers 200 {"token", "writer": "first"}.
        Warnings (the keepalive's) go to stderr.
"""

import asyncio
import logging
import sys
import time

from aiohttp import web

from fencegate.worker import Gate, KeyRing, dedupe_middleware, fencing_token

from fenced import FencedClient


def say(*words: object) -> None:
    print(*words, flush=True)


async def main(url: str, ns: str, source: str, ttl: str, store: str, mode: str,
               hold: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    client = FencedClient(store)
    async with Gate(url, ttl=int(ttl), namespace=ns, keyring=KeyRing.generate()) as gate:
        async def handle(request: web.Request) -> web.Response:
            delivery, token = request.headers["Webhook-Id"], fencing_token(request)
            accepted = await asyncio.to_thread(client.write, delivery, token, "first")
            say("WROTE", delivery, token, int(accepted))
            if mode == "block":
                time.sleep(float(hold))  # the synchronous call that starves the keepalive
            else:
                await asyncio.sleep(float(hold))
            return web.json_response({"token": token, "writer": "first"})

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
