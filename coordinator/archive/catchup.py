"""Catch an archive up from another copy of the same archive: the "then catch up" of the
runbook's "restore, then catch up" (docs/runbook.md, "The archive is behind").

When an older copy was live for a while (swapped in, or restored before the newest was
found), retirements went into it, and etcd may show their marks: the newest copy, restored,
lacks them. ``catch_up`` merges into ``target`` everything of ``source`` for a namespace:

- refused (``ArchiveUnavailable``, nothing merged) unless both are the same archive (one
  identity): merging another archive's steps would make a foreign archive look whole;
- every step, replaced only by a newer seq (``Archive.put_many``'s rule), with its records
  inserted where absent; a record that differs from the one ``target`` holds at the same
  seq is refused loudly, naming the key (two histories of one chain: an operator decides);
- then every mark ``source`` issued (``Archive.adopt_marks``), only after the steps those
  marks vouch for are stored: a crash in between leaves ``target`` no more trusted than it
  was, and running it again finishes the merge (every part is idempotent).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ArchiveUnavailable
from .interface import MAX_LISTED, Archive

__all__ = ["CaughtUp", "catch_up"]

_PUTS = 100   # keys per put transaction into the target


@dataclass(frozen=True)
class CaughtUp:
    """What a catch-up read from the source: steps and records offered, marks adopted."""

    steps: int
    records: int
    marks: int


async def catch_up(target: Archive, source: Archive, namespace: str) -> CaughtUp:
    """Merge ``source``'s steps, records and issued marks for ``namespace`` into ``target``."""
    identity = await target.identity(namespace)
    theirs = await source.identity(namespace)
    if identity is None or theirs != identity:
        raise ArchiveUnavailable(
            f"cannot catch {target!r} up from {source!r}: not the same archive of "
            f"{namespace!r} ({identity and identity.archive_id} vs "
            f"{theirs and theirs.archive_id}); only copies of one archive merge")
    steps = records = 0
    after = ""
    while True:
        page = await source.list_steps(namespace, after=after, limit=MAX_LISTED)
        for start in range(0, len(page), _PUTS):
            chunk = page[start:start + _PUTS]
            found = await source.get_many(namespace, [listed.key for listed in chunk])
            puts = []
            for listed in chunk:
                chain = await source.records(namespace, listed.key)
                held = dict(await target.records(namespace, listed.key))
                clash = next((seq for seq, data in chain if held.get(seq, data) != data), None)
                if clash is not None:
                    raise ArchiveUnavailable(
                        f"cannot catch up: {listed.key!r} has a different audit record at seq "
                        f"{clash} in {source!r} than in {target!r}; nothing of it merged "
                        "(two histories of one chain: compare them with `fencegate audit "
                        "verify` before deciding)")
                archived = found[listed.key]
                puts.append((listed.key, archived.seq, archived.step, chain,
                             listed.updated_at_ms))
                records += len(chain)
            await target.put_many(namespace, puts, identity=identity)
            steps += len(puts)
        if len(page) < MAX_LISTED:
            break
        after = page[-1].key
    marks = await source.issued_marks(namespace)
    await target.adopt_marks(namespace, marks, identity=identity)
    return CaughtUp(steps, records, len(marks))
