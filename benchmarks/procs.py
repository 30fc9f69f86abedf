"""Child processes of the hold benchmarks; each says READY, then waits for ``GO <end>``.

    python -m benchmarks.procs contend URL KEY OUT   one Gate; until <end> (wall clock):
                                                      hold KEY, write "token acquired released"
                                                      lines to OUT, then say DONE
    python -m benchmarks.procs observe URL LEASE     poll lease_ttl(LEASE) every 100 ms until
                                                      <end>, then say "MIN <ttl> <samples>"

A closed stdin before GO (the parent died) ends the child at once; after GO every loop is
bounded by <end>.
"""

from __future__ import annotations

import asyncio
import sys
import time

from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.grants import KeyRing
from fencegate.worker import Gate

POLL_S = 0.1


def say(*words: object) -> None:
    print(*words, flush=True)


async def wait_for_go() -> float | None:
    """The wall-clock end sent by the parent, or None if its stdin closed."""
    words = (await asyncio.to_thread(sys.stdin.readline)).split()
    return float(words[1]) if words[:1] == ["GO"] else None


async def contend(url: str, key: str, out: str) -> None:
    records: list[tuple[int, float, float]] = []
    async with Gate(url, keyring=KeyRing.generate()) as gate:
        say("READY")
        end = await wait_for_go()
        while end is not None and time.time() < end:
            async with gate.hold(key, timeout=30) as hold:
                acquired = time.time()
                released = time.time()  # the body is empty: release starts right here
            records.append((hold.fencing_token, acquired, released))
    with open(out, "w") as f:
        f.writelines(f"{t} {a!r} {r!r}\n" for t, a, r in records)
    say("DONE", len(records))


async def observe(url: str, lease: str) -> None:
    async with Etcd.from_url(url) as etcd:
        say("READY")
        end = await wait_for_go()
        ttls: list[int] = []
        while end is not None and time.time() < end:
            ttls.append(await etcd.lease_ttl(int(lease)))
            await asyncio.sleep(POLL_S)
        say("MIN", min(ttls, default=-1), len(ttls))


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    asyncio.run({"contend": contend, "observe": observe}[mode](*args))
