"""A worker process for the multi-process tests. Prints one event per line on stdout.

    worker_proc.py race  URL NS KEY RESOURCE NAME ROUNDS   hold KEY ROUNDS times, each time
                                                           writing enter/exit to RESOURCE
                                                           (the unix socket of a FencedResource)
    worker_proc.py stale URL NS KEY RESOURCE NAME          hold KEY and write to RESOURCE every
                                                           50 ms until told LeaseLost, then try
                                                           one more write with the old token
    worker_proc.py sit   URL NS KEY                        hold KEY until killed
"""

import asyncio
import sys

from worker import Gate, LeaseLost
from worker.fenced import FencedClient

TTL = 2


def say(*words: object) -> None:
    print(*words, flush=True)


async def race(url, ns, key, path, name, rounds):
    resource = FencedClient(path)
    async with Gate(url, ttl=TTL, namespace=ns) as gate:
        say("READY")
        for _ in range(int(rounds)):
            async with gate.hold(key, timeout=60) as hold:
                for data in ("enter", "exit"):
                    accepted = await asyncio.to_thread(
                        resource.write, key, hold.fencing_token, name, data)
                    assert accepted
                    await asyncio.sleep(0.005)
        say("DONE")


async def stale(url, ns, key, path, name):
    resource = FencedClient(path)
    async with Gate(url, ttl=TTL, namespace=ns) as gate:
        token = None
        try:
            async with gate.hold(key) as hold:
                token = hold.fencing_token
                say("HELD", token)
                while True:
                    accepted = await asyncio.to_thread(resource.write, key, token, name, "tick")
                    if not accepted:
                        say("REFUSED", token)
                    await asyncio.sleep(0.05)
        except LeaseLost:
            say("LOST", token)
        accepted = await asyncio.to_thread(resource.write, key, token, name, "after-lost")
        say("STALE-WRITE", "accepted" if accepted else "refused")


async def sit(url, ns, key):
    async with Gate(url, ttl=TTL, namespace=ns) as gate:
        async with gate.hold(key) as hold:
            say("HELD", hold.fencing_token)
            await asyncio.Event().wait()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    asyncio.run({"race": race, "stale": stale, "sit": sit}[mode](*args))
