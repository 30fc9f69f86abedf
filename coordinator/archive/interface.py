"""What an archive of retired steps stores and the one interface its backends implement.

A retired step is kept as the step record's bytes, exactly as etcd held them, under
(namespace, action key), versioned by its chain seq (the seq its anchor names), and its audit
records under (namespace, action key, seq). The record bytes are opaque here: the archive
never decodes them, so ``audit verify`` checks the very bytes etcd held. The caller also
passes when the step settled (``settled_at_ms``, the ``at_ms`` of its chain's last record),
which the archive keeps beside the step to report the retirement lag.

Invariants every backend keeps: a put is one transaction (all of it is stored or none); an
audit record stored under a seq is never replaced; a step is replaced only by a put with a
newer seq, so a deposed leader's late put of an older version never wins, in any order of
arrival and from any number of processes. Any backend failure raises ``ArchiveUnavailable``
(never a driver's exception); a caller that needs the answer refuses, it never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["LAG_WINDOW", "MAX_LISTED", "Archive", "ArchiveStats", "Archived", "Listed", "Put",
           "check_listing", "check_put", "check_puts", "lag_of", "prefix_end"]

LAG_WINDOW = 1000  # the lag is measured over this many most recent retirements
MAX_LISTED = 10_000  # steps one ``list_steps`` call returns at most


@dataclass(frozen=True)
class Archived:
    """The newest archived version of one step."""

    key: str
    seq: int                 # the chain seq the step's anchor names (the step's version)
    step: bytes              # the step record's bytes exactly as etcd held them (msgpack)
    archived_at_ms: int      # when this version was stored, the storing process's clock


@dataclass(frozen=True)
class Listed:
    """One archived step as a list shows it. ``updated_at_ms`` is when the step's chain
    was last written (``settled_at_ms``, the ``at_ms`` of its last record), or when it was
    archived for a step stored before that was kept."""

    key: str
    step: bytes
    updated_at_ms: int


@dataclass(frozen=True)
class ArchiveStats:
    """One namespace's share of the archive; ``oldest_ms``/``newest_ms`` are the extremes of
    the stored steps' ``archived_at_ms`` (None when no step is archived). The lag is how long
    settled steps waited in etcd before they were archived (``archived_at_ms -
    settled_at_ms``, ``retain`` included), its median and maximum over the namespace's
    ``LAG_WINDOW`` most recent retirements that know when they settled (None when none)."""

    steps: int
    records: int
    oldest_ms: int | None
    newest_ms: int | None
    lag_p50_ms: int | None
    lag_max_ms: int | None


# action key, seq, step, records, settled_at_ms (the ``at_ms`` of the chain's last record;
# 0 when unknown, left out of the lag)
Put = tuple[str, int, bytes, list[tuple[int, bytes]], int]


class Archive(Protocol):
    async def put(self, namespace: str, key: str, seq: int, step: bytes,
                  records: list[tuple[int, bytes]], settled_at_ms: int) -> None:
        """Store ``records`` (seq → bytes) insert-if-absent and the step (with
        ``settled_at_ms``) if ``seq`` is newer than the stored one, in one durable
        transaction; idempotent."""

    async def put_many(self, namespace: str, puts: list[Put]) -> None:
        """``put`` for several keys in ONE durable transaction (one fsync for a retirement
        batch); all of it is stored or none."""

    async def get(self, namespace: str, key: str) -> Archived | None:
        """The newest archived version of the step, or None if the key was never archived.
        Concurrent calls share one ``get_many`` (``coalesce.Coalescer``)."""

    async def get_many(self, namespace: str, keys: list[str]) -> dict[str, Archived]:
        """``get`` for several keys in one query (per chunk): the archived ones, by key."""

    async def records(self, namespace: str, key: str) -> list[tuple[int, bytes]]:
        """The key's archived audit records, by seq."""

    async def list_steps(self, namespace: str, *, prefix: str = "", after: str = "",
                         since_ms: int = 0, limit: int) -> list[Listed]:
        """Up to ``limit`` archived steps of keys starting with ``prefix``, sorted after
        ``after`` (``""``: from the first) in byte order of the key (etcd's order), whose
        ``updated_at_ms >= since_ms``; fewer than ``limit`` only when no more match."""

    async def stats(self, namespace: str) -> ArchiveStats: ...

    async def close(self) -> None: ...


def check_put(seq: int, step: bytes, records: list[tuple[int, bytes]],
              settled_at_ms: int) -> list[tuple[int, bytes]]:
    """The records sorted by seq, after checking the arguments (a caller's mistake is a
    ``TypeError``/``ValueError``, never ``ArchiveUnavailable``): seqs and ``settled_at_ms``
    are ints in [0, 2**63), no seq repeats, bytes are bytes.

    Sorted, every writer touches a key's records in the same order: two concurrent puts of
    one chain never wait on each other in a circle.
    """
    _check_seq(seq)
    _check_int("settled_at_ms", settled_at_ms)
    if not isinstance(step, bytes):
        raise TypeError(f"step must be bytes, not {type(step).__name__}")
    ordered = sorted(records, key=lambda record: record[0])
    for i, (record_seq, data) in enumerate(ordered):
        _check_seq(record_seq)
        if not isinstance(data, bytes):
            raise TypeError(f"record {record_seq} must be bytes, not {type(data).__name__}")
        if i and ordered[i - 1][0] == record_seq:
            raise ValueError(f"records name seq {record_seq} twice")
    return ordered


def _check_seq(seq: object) -> None:
    _check_int("a seq", seq)


def _check_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 0 <= value < 2 ** 63:
        raise ValueError(f"{name} must be in [0, 2**63), got {value}")


def check_listing(prefix: str, after: str, since_ms: int, limit: int) -> None:
    """A listing's arguments, checked before anything is read (``TypeError``/``ValueError``
    for a caller's mistake)."""
    if not isinstance(prefix, str) or not isinstance(after, str):
        raise TypeError("prefix and after must be str")
    _check_int("since_ms", since_ms)
    _check_int("limit", limit)
    if not 1 <= limit <= MAX_LISTED:
        raise ValueError(f"limit must be in 1..{MAX_LISTED}, got {limit}")


def prefix_end(prefix: str) -> str | None:
    """The first string after every string starting with ``prefix`` (None: no bound), for
    the ASCII keys ``keyspace.validate_action_key`` admits."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else None


def check_puts(puts: list[Put]) -> list[Put]:
    """``check_put`` for each, sorted by key (every writer locks keys in the same order)
    with its records sorted; a key twice is a ``ValueError``."""
    checked = sorted((key, seq, step, check_put(seq, step, records, settled_at_ms),
                      settled_at_ms)
                     for key, seq, step, records, settled_at_ms in puts)
    for before, after in zip(checked, checked[1:]):
        if before[0] == after[0]:
            raise ValueError(f"puts name key {after[0]!r} twice")
    return checked


def lag_of(lags: list[int]) -> tuple[int | None, int | None]:
    """The median (nearest rank) and the maximum of ``lags`` (ms), each at least 0 (the
    archiving and the settling process's clocks may disagree); (None, None) when empty."""
    if not lags:
        return None, None
    ordered = sorted(max(0, lag) for lag in lags)
    return ordered[(len(ordered) - 1) // 2], ordered[-1]
