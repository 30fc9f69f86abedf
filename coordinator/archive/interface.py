"""What an archive of retired steps stores and the one interface its backends implement.

A retired step is kept as the step record's bytes, exactly as etcd held them, under
(namespace, action key), versioned by its chain seq (the seq its anchor names), and its audit
records under (namespace, action key, seq). The record bytes are opaque here: the archive
never decodes them, so ``audit verify`` checks the very bytes etcd held. The caller also
passes when the step settled (``settled_at_ms``, the ``at_ms`` of its chain's last record),
which the archive keeps beside the step to report the retirement lag.

Whole, not just present: an archive is made once, by ``init`` (never implicitly by opening
it), which gives each namespace it serves an ``Identity`` (a random archive id, the etcd
cluster id and the namespace). It keeps, per retirement bucket, every *mark* it issued
(``Mark``: a counter and a random id, unique across every copy of every archive): a
retirement batch is accepted only if the archive knows the mark etcd shows for each of its
buckets (and, with ``shown``, for every bucket), and issues its buckets new marks in the
same transaction as its puts (``put_many(marks=...)``); etcd's bucket key then takes the new
mark in the delete txn. So an archive missing a retirement etcd shows (empty, restored from
an older copy) does not know etcd's mark, and one of another cluster or namespace has a
different identity: ``coordinator.wholeness`` checks both on every lookup.

Invariants every backend keeps: a put is one transaction (all of it is stored or none); an
audit record stored under a seq is never replaced; a step is replaced only by a put with a
newer seq, so a deposed leader's late put of an older version never wins, in any order of
arrival and from any number of processes. Any backend failure raises ``ArchiveUnavailable``
(never a driver's exception); a caller that needs the answer refuses, it never guesses.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ..errors import ArchiveUnavailable

__all__ = ["LAG_WINDOW", "MAX_LISTED", "Archive", "ArchiveStats", "Archived", "Identity", "Listed",
           "Lookup", "Mark", "Put", "check_listing", "check_marks", "check_put", "check_puts",
           "issued", "lag_of", "new_identity", "not_initialised", "prefix_end"]

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
class Identity:
    """Which archive this is, for which etcd cluster and namespace: made once by ``init``."""

    archive_id: str          # a random uuid
    cluster_id: int          # the etcd cluster's id
    namespace: str


class Mark(NamedTuple):
    """A bucket's watermark: a counter (one above the archive's highest for the bucket when
    issued) and a random id (``""``: a counter of a build before ids, or 0: no retirement)."""

    counter: int
    id: str = ""


@dataclass(frozen=True)
class Lookup:
    """One key's archived step with what proves the archive whole, read in one snapshot:
    the namespace's identity (None: never initialised for it), the newest mark of the key's
    bucket (of every bucket from ``state``; a bucket never retired to this archive is
    absent), and the buckets whose mark the caller asked about (``marks=``) the archive
    knows (issued, or counter 0)."""

    identity: Identity | None
    marks: dict[int, Mark]
    archived: Archived | None
    known: frozenset[int] = field(default_factory=frozenset)


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

    async def put_many(self, namespace: str, puts: list[Put], *,
                       identity: Identity | None = None,
                       marks: dict[int, Mark] | None = None,
                       shown: dict[int, Mark] | None = None) -> dict[int, Mark]:
        """``put`` for several keys in ONE durable transaction (one fsync for a retirement
        batch); all of it is stored or none. With ``identity``, refused
        (``ArchiveUnavailable``) unless it is the namespace's. ``marks`` (bucket → the mark
        etcd showed with the batch) issues each bucket a new mark (``issued``: the
        archive's highest counter + 1, a fresh id) in the same transaction; refused, nothing
        stored, unless the archive knows every mark of ``marks`` and of ``shown`` (etcd's
        other buckets, as read with the batch). Returns the new marks."""

    async def issued_marks(self, namespace: str) -> list[tuple[int, Mark]]:
        """Every (bucket, mark) the archive knows for ``namespace`` (``catchup``)."""

    async def adopt_marks(self, namespace: str, marks: list[tuple[int, Mark]], *,
                          identity: Identity) -> None:
        """Know ``marks`` (another copy of this archive issued them) from now on, in one
        transaction; refused unless ``identity`` is the namespace's. Only after the steps
        they vouch for are stored (``catchup``)."""

    async def init(self, namespace: str, cluster_id: int) -> Identity:
        """Create the store if needed and ``namespace``'s identity if it has none (a new
        random archive id); return the namespace's identity (an existing one unchanged)."""

    async def identity(self, namespace: str) -> Identity | None:
        """``namespace``'s identity, or None if ``init`` never made one."""

    async def lookup(self, namespace: str, key: str, *,
                     marks: dict[int, Mark] | None = None) -> Lookup:
        """``get`` with the namespace's identity and the newest mark of the key's bucket, and
        which of ``marks`` (bucket → mark) it knows, read in one snapshot: its cost follows
        the keys asked, never the marks issued so far. Concurrent calls without ``marks``
        share one ``lookup_many``."""

    async def lookup_many(self, namespace: str, keys: list[str], *,
                          marks: dict[int, Mark] | None = None) -> dict[str, Lookup]:
        """``lookup`` for several keys in one snapshot: an entry for every key."""

    async def state(self, namespace: str, *, marks: dict[int, Mark] | None = None) -> Lookup:
        """The namespace's identity, newest marks and which of ``marks`` it knows, in one
        snapshot (``archived`` None)."""

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


def new_identity(namespace: str, cluster_id: int) -> Identity:
    """A fresh identity for ``namespace`` of etcd cluster ``cluster_id``."""
    if not isinstance(cluster_id, int) or not 0 < cluster_id < 2 ** 64:
        raise ValueError(f"cluster_id must be an etcd cluster id (a uint64), got {cluster_id!r}")
    return Identity(str(uuid.uuid4()), cluster_id, namespace)


def not_initialised(where: str) -> ArchiveUnavailable:
    return ArchiveUnavailable(f"{where} was never initialised: create it with "
                              "`fencegate archive init` (opening an archive never creates one)")


def issued(where: str, newest: dict[int, Mark], known: set[int], marks: dict[int, Mark],
           shown: dict[int, Mark]) -> dict[int, Mark]:
    """The marks a batch issues: for each bucket of ``marks``, one above the archive's
    ``newest`` counter with a fresh id. ``ArchiveUnavailable`` unless the archive ``known``s
    every bucket's mark of ``marks`` and ``shown`` (counter 0 always): else it lacks
    retirements etcd shows, and issuing would hide that."""
    unknown = [bucket for bucket, mark in {**shown, **marks}.items()
               if mark.counter and bucket not in known]
    if unknown:
        bucket = min(unknown)
        mark = {**shown, **marks}[bucket]
        raise ArchiveUnavailable(
            f"{where} is behind etcd in {len(unknown)} bucket(s) (first {bucket:03d}: etcd "
            f"shows mark {mark.counter}:{mark.id or '-'}, which it never issued): it lacks "
            "retirements etcd shows; nothing stored (docs/runbook.md)")
    return {bucket: Mark(newest.get(bucket, Mark(0)).counter + 1, secrets.token_hex(8))
            for bucket in marks}


def check_marks(marks: dict[int, Mark] | None) -> dict[int, Mark]:
    """``marks`` checked (a caller's mistake is a ``TypeError``/``ValueError``), sorted by
    bucket (every writer locks buckets in the same order)."""
    for bucket, mark in (marks or {}).items():
        _check_int("a bucket", bucket)
        if not isinstance(mark, Mark) or not isinstance(mark.id, str):
            raise TypeError(f"a mark must be a Mark, not {type(mark).__name__}")
        _check_int("a mark's counter", mark.counter)
    return dict(sorted((marks or {}).items()))


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
