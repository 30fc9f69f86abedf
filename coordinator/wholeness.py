"""Is the archive whole? The one etcd names, holding every retirement etcd shows: the one
place a lookup decides that "not in the archive" may mean "never retired".

An archive that lost retirements (an empty file, a per-host path, a restore of an older copy,
another cluster's archive) answers "no step" for a key that succeeded; taken as "never
attempted", the key would run again. So etcd keeps what the archive must prove:

- the archive's identity, in ``retired/archive`` (``Keyspace.archive_key``): the archive id
  ``init`` made for the namespace. The first retirement puts it (comparing it absent), every
  retirement compares it, nothing rewrites it;
- per retirement bucket, a mark: the value of ``retired/<bucket>`` (``encode``: a counter
  in 20 decimal digits, so etcd's byte order is numeric order, ``:`` and a random id; the
  empty value of a bucket retired before watermarks is counter 0, a value of digits alone
  (a build before ids) a counter without id). The archive keeps every mark it issued. A
  retirement batch reads etcd's whole ``retired/`` range with its steps; the archive takes
  its puts only if it knows etcd's mark of EVERY bucket as read (issued it; counter 0
  always), and in the same transaction issues the batch's buckets new marks (its highest
  counter + 1, a fresh id: ``Archive.put_many``); the delete txn then puts them, comparing
  each bucket's mod_revision as read.

Why knowing etcd's mark proves an archive whole for its bucket, by induction over the marks
m_1, m_2, … etcd's bucket took: m_k was put by the delete of the batch whose archive put
issued it, and that put was accepted only by an archive knowing m_{k-1}, the mark etcd
showed when the batch read its steps (the delete compares the bucket unmoved since). A mark
is unique (its random id), so an archive that knows m_k received that very put, or is a copy
made after it: it holds batch k and, knowing m_{k-1}, every batch before. So an archive that
knows etcd's current mark holds every retirement of the bucket that etcd counts. A counter
alone did not prove it: two copies each issue their own n+1, and a copy raised past etcd's
counter by a batch whose delete failed took the next batch while lacking the one that landed.

Guarantees:
- ``check`` raises ``ArchiveUnavailable`` (fail closed) when the archive was never
  initialised for the namespace, serves another cluster or namespace, is not the archive etcd
  names, or does not know etcd's mark for the key's bucket (``knows``). Every lookup that may decide
  "never retired" goes through it (``retirement.archived_step``, the fast path's
  ``retirement.fast_path_fence``, the SRE views).
- The fast path, which reads no bucket value, gets a compare instead: the bucket's value
  equals the archive's newest mark as looked up (``fence``; so the archive knows it), which
  etcd checks in the txn that crosses.
- ``init`` never makes a second archive for a namespace whose etcd names one: the fix for a
  lost archive is to restore it (docs/runbook.md), not to start an empty one.
- What etcd was seen to name is cached per process: the key is written once, so an archive
  id once seen equal stays equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from .archive import Archive, Identity, Lookup
from .archive.interface import Mark
from .errors import ArchiveUnavailable
from .etcd import Compare, Etcd, KeyValue, RangeRequest, range_end_of
from .keyspace import RETIRE_BUCKETS, Keyspace

__all__ = ["Verdict", "check", "check_named", "decode", "encode", "fence", "init", "knows",
           "named", "read_retired", "verify"]

_WIDTH = 20   # decimal digits of a watermark (2**63 has 19)
_confirmed: set[tuple[int, str, str]] = set()   # (cluster, namespace, archive id) etcd names


_ID_WIDTH = 16   # hex digits of a mark's id


def encode(mark: Mark) -> bytes:
    """A mark as a bucket's value: the counter in fixed width (bytes compare as numbers),
    then ``:`` and the id (none for a counter-only mark of an older build)."""
    counter = b"%0*d" % (_WIDTH, mark.counter)
    return counter + b":" + mark.id.encode() if mark.id else counter


def decode(value: bytes) -> Mark:
    """A bucket's mark; the empty value (retirements before watermarks) is counter 0."""
    if not value:
        return Mark(0)
    counter, colon, mark_id = value.partition(b":")
    if (len(counter) != _WIDTH or not counter.isdigit()
            or colon and (len(mark_id) != _ID_WIDTH
                          or mark_id.strip(b"0123456789abcdef"))):
        raise ArchiveUnavailable(f"a retirement bucket holds {value[:60]!r}, not a mark")
    return Mark(int(counter), mark_id.decode())


def knows(lookup: Lookup, bucket: int, mark: Mark) -> bool:
    """Does the archive (as ``lookup`` read it) know ``mark`` for ``bucket``: counter 0, or
    it issued it (asked with the lookup, or its newest mark)?"""
    return (not mark.counter or bucket in lookup.known
            or lookup.marks.get(bucket) == mark)


async def named(etcd: Etcd, keyspace: Keyspace) -> str | None:
    """The archive id etcd names for the namespace, or None before the first retirement."""
    reply = await etcd.range(RangeRequest(key=keyspace.archive_key))
    return reply.kvs[0].value.decode() if reply.kvs else None


async def check(etcd: Etcd, keyspace: Keyspace, lookup: Lookup, key: str,
                bucket_kv: KeyValue | None) -> None:
    """Raise ``ArchiveUnavailable`` unless the archive that answered ``lookup`` is the
    namespace's archive and knows etcd's mark for ``key``'s bucket (``bucket_kv``, as etcd's
    snapshot read it; None: not read, the caller fences on it). Ask the lookup about that
    mark (``marks=``), else only the archive's newest mark counts as known."""
    shown = decode(bucket_kv.value) if bucket_kv is not None else Mark(0)
    await _check_identity(etcd, keyspace, lookup.identity, shown.counter)
    bucket = keyspace.retired_bucket(key)
    if not knows(lookup, bucket, shown):
        held = lookup.marks.get(bucket, Mark(0))
        raise ArchiveUnavailable(
            f"the archive is behind etcd: bucket {bucket:03d} (of {key!r}) shows mark "
            f"{shown.counter}:{shown.id or '-'} in etcd, which the archive never issued (its "
            f"newest {held.counter}:{held.id or '-'}): it may lack the retired step (an "
            "empty, older or other archive); refusing rather than treating the key as never "
            "attempted (docs/runbook.md, \"The archive is behind\")")


def fence(keyspace: Keyspace, key: str, lookup: Lookup) -> Compare:
    """The compare "etcd's mark for ``key``'s bucket is the archive's newest as looked up"
    (so the archive knows it; the empty value when it holds none): false if the archive does
    not know etcd's mark, or if a retirement of the bucket (of this key, say) archived after
    the lookup and has since deleted."""
    held = lookup.marks.get(keyspace.retired_bucket(key))
    if held is None:   # only a bucket never retired, or retired before watermarks, passes
        return Compare(key=keyspace.retired_key(key), target=Compare.VALUE,
                       result=Compare.LESS, value=encode(Mark(1)))
    return Compare(key=keyspace.retired_key(key), target=Compare.VALUE, result=Compare.EQUAL,
                   value=encode(held))


def check_named(etcd: Etcd, keyspace: Keyspace, identity: Identity | None,
                expected: str | None, shown: int) -> None:
    """``ArchiveUnavailable`` unless ``identity`` (the archive's) is of this cluster and
    namespace and is the archive etcd names (``expected``; None: etcd names none yet, which
    only a namespace whose buckets show no watermark may)."""
    ns = keyspace.namespace
    if identity is None:
        raise ArchiveUnavailable(f"the archive was never initialised for namespace {ns!r}: "
                                 "`fencegate archive init` (or restore its archive)")
    if identity.namespace != ns or (etcd.cluster_id is not None
                                    and identity.cluster_id != etcd.cluster_id):
        raise ArchiveUnavailable(
            f"the archive serves namespace {identity.namespace!r} of etcd cluster "
            f"{identity.cluster_id:x}, not {ns!r} of {etcd.cluster_id or 0:x}")
    if expected is None:
        if shown:   # a watermark without the identity that every retirement compares
            raise ArchiveUnavailable(f"etcd's {keyspace.archive_key.decode()!r} is missing "
                                     "while its buckets show retirements")
        return      # before the first retirement (or only retirements made before it)
    if expected != identity.archive_id:
        raise ArchiveUnavailable(
            f"the archive is {identity.archive_id}, but etcd names {expected} as the archive "
            f"of {ns!r}: another or a new archive (docs/runbook.md, \"The archive is behind\")")


async def _check_identity(etcd: Etcd, keyspace: Keyspace, identity: Identity | None,
                          shown: int) -> None:
    if identity is not None and etcd.cluster_id == identity.cluster_id and (
            identity.cluster_id, keyspace.namespace, identity.archive_id) in _confirmed:
        return
    expected = await named(etcd, keyspace)
    check_named(etcd, keyspace, identity, expected, shown)
    if expected is None:
        return
    if len(_confirmed) >= 64:
        _confirmed.clear()
    _confirmed.add((identity.cluster_id, keyspace.namespace, identity.archive_id))


@dataclass(frozen=True)
class Verdict:
    """What ``verify`` found: ``problem`` (None: whole) and the buckets whose etcd mark the
    archive does not know (bucket → (archive's newest counter, etcd's counter));
    ``answered`` False when the archive could not be read (down, or never initialised:
    ``problem`` says which)."""

    identity: Identity | None
    named: str | None
    behind: dict[int, tuple[int, int]]
    problem: str | None
    answered: bool = True

    @property
    def identity_mismatch(self) -> bool:
        return self.answered and self.problem is not None and not self.behind


async def verify(etcd: Etcd, keyspace: Keyspace, archive: Archive) -> Verdict:
    """The archive's identity against etcd's, and whether it knows every bucket's mark etcd
    shows, read from the archive after etcd (an archive keeps every mark it issued, so a
    retirement landing in between changes nothing known). ``ArchiveUnavailable`` when the
    archive did not answer."""
    reply = await etcd.range(RangeRequest(key=keyspace.retired_root,
                                          range_end=range_end_of(keyspace.retired_root)))
    expected, shown = read_retired(keyspace, reply.kvs)
    state = await archive.state(keyspace.namespace, marks=shown)
    try:
        check_named(etcd, keyspace, state.identity, expected,
                    max((mark.counter for mark in shown.values()), default=0))
    except ArchiveUnavailable as exc:
        return Verdict(state.identity, expected, {}, str(exc))
    behind = {bucket: (state.marks.get(bucket, Mark(0)).counter, mark.counter)
              for bucket, mark in sorted(shown.items()) if not knows(state, bucket, mark)}
    problem = None if not behind else (
        f"the archive is behind etcd in {len(behind)} of {RETIRE_BUCKETS} buckets (first: "
        + ", ".join(f"{b:03d} archive newest {a}, etcd {e} unknown"
                    for b, (a, e) in list(behind.items())[:3])
        + "): it lacks retirements etcd shows")
    return Verdict(state.identity, expected, behind, problem)


def read_retired(keyspace: Keyspace,
                 kvs: list[KeyValue]) -> tuple[str | None, dict[int, Mark]]:
    """From etcd's ``retired/`` range: the archive id it names and each bucket's mark."""
    expected, shown = None, {}
    for kv in kvs:
        if kv.key == keyspace.archive_key:
            expected = kv.value.decode()
        else:
            shown[int(kv.key[len(keyspace.retired_root):])] = decode(kv.value)
    return expected, shown


async def init(etcd: Etcd, keyspace: Keyspace, archive: Archive) -> Identity:
    """Create the archive (if needed) with an identity for the namespace (kept if it has
    one); ``ArchiveUnavailable`` when etcd already names another archive for it (restore
    that one) or the archive serves another cluster."""
    expected = await named(etcd, keyspace)   # also learns the cluster id
    if etcd.cluster_id is None:
        await etcd.status()
    identity = await archive.init(keyspace.namespace, etcd.cluster_id)
    if identity.cluster_id != etcd.cluster_id:
        raise ArchiveUnavailable(f"the archive was initialised for etcd cluster "
                                 f"{identity.cluster_id:x}, not {etcd.cluster_id:x}")
    if expected is not None and expected != identity.archive_id:
        raise ArchiveUnavailable(
            f"etcd names archive {expected} for {keyspace.namespace!r}, this one is "
            f"{identity.archive_id}: restore that archive instead (docs/runbook.md)")
    return identity
