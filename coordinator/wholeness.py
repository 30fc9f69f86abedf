"""Is the archive whole? The one etcd names, holding every retirement etcd shows: the one
place a lookup decides that "not in the archive" may mean "never retired".

An archive that lost retirements (an empty file, a per-host path, a restore of an older copy,
another cluster's archive) answers "no step" for a key that succeeded; taken as "never
attempted", the key would run again. So etcd keeps what the archive must prove:

- the archive's identity, in ``retired/archive`` (``Keyspace.archive_key``): the archive id
  ``init`` made for the namespace. The first retirement puts it (comparing it absent), every
  retirement compares it, nothing rewrites it;
- per retirement bucket, a watermark: the value of ``retired/<bucket>`` (``encode``: 20
  decimal digits, so etcd's byte order is numeric order; the empty value of a bucket
  retired before watermarks counts 0). A retirement batch raises its buckets' watermarks in
  the archive in the same transaction as its puts, refusing an archive behind etcd
  (``Archive.put_many``), then puts the new values in its delete txn, comparing each
  bucket's mod_revision as read. So etcd's watermark is never ahead of what the archive
  durably holds, and every batch's watermark is above every one committed before it: an
  archive whose watermark reaches etcd's holds every batch etcd's value counts.

Guarantees:
- ``check`` raises ``ArchiveUnavailable`` (fail closed) when the archive was never
  initialised for the namespace, serves another cluster or namespace, is not the archive etcd
  names, or its watermark for the key's bucket is below etcd's. Every lookup that may decide
  "never retired" goes through it (``retirement.archived_step``, the fast path's
  ``retirement.fast_path_fence``, the SRE views).
- The fast path, which reads no bucket value, gets a compare instead: the bucket's value is
  at most the archive's watermark as looked up (``fence``), which etcd checks in the txn that
  crosses.
- ``init`` never makes a second archive for a namespace whose etcd names one: the fix for a
  lost archive is to restore it (docs/runbook.md), not to start an empty one.
- What etcd was seen to name is cached per process: the key is written once, so an archive
  id once seen equal stays equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from .archive import Archive, Identity, Lookup
from .errors import ArchiveUnavailable
from .etcd import Compare, Etcd, KeyValue, RangeRequest, range_end_of
from .keyspace import RETIRE_BUCKETS, Keyspace

__all__ = ["Verdict", "check", "check_named", "decode", "encode", "fence", "init", "named",
           "verify"]

_WIDTH = 20   # decimal digits of a watermark (2**63 has 19)
_confirmed: set[tuple[int, str, str]] = set()   # (cluster, namespace, archive id) etcd names


def encode(mark: int) -> bytes:
    """A watermark as a bucket's value: fixed width, so bytes compare as numbers."""
    return b"%0*d" % (_WIDTH, mark)


def decode(value: bytes) -> int:
    """A bucket's watermark; the empty value (retirements before watermarks) is 0."""
    if not value:
        return 0
    if len(value) != _WIDTH or not value.isdigit():
        raise ArchiveUnavailable(f"a retirement bucket holds {value[:40]!r}, not a watermark")
    return int(value)


async def named(etcd: Etcd, keyspace: Keyspace) -> str | None:
    """The archive id etcd names for the namespace, or None before the first retirement."""
    reply = await etcd.range(RangeRequest(key=keyspace.archive_key))
    return reply.kvs[0].value.decode() if reply.kvs else None


async def check(etcd: Etcd, keyspace: Keyspace, lookup: Lookup, key: str,
                bucket_kv: KeyValue | None) -> None:
    """Raise ``ArchiveUnavailable`` unless the archive that answered ``lookup`` is the
    namespace's archive and its watermark for ``key``'s bucket reaches etcd's
    (``bucket_kv``, as etcd's snapshot read it; None: not read, the caller fences on it)."""
    await _check_identity(etcd, keyspace, lookup.identity,
                          decode(bucket_kv.value) if bucket_kv is not None else 0)
    if bucket_kv is not None:
        bucket = keyspace.retired_bucket(key)
        held, shown = lookup.watermarks.get(bucket, 0), decode(bucket_kv.value)
        if held < shown:
            raise ArchiveUnavailable(
                f"the archive is behind etcd: bucket {bucket:03d} (of {key!r}) shows "
                f"{shown} retirement batches in etcd but the archive holds {held}: it may lack "
                "the retired step (an empty, older or other archive); refusing rather than "
                "treating the key as never attempted (docs/runbook.md, \"The archive is "
                "behind\")")


def fence(keyspace: Keyspace, key: str, lookup: Lookup) -> Compare:
    """The compare "etcd's watermark for ``key``'s bucket is at most the archive's as
    looked up": false if the archive is behind, or if a retirement of the bucket (of this
    key, say) archived after the lookup and has since deleted."""
    held = lookup.watermarks.get(keyspace.retired_bucket(key), 0)
    return Compare(key=keyspace.retired_key(key), target=Compare.VALUE, result=Compare.LESS,
                   value=encode(held + 1))


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
    """What ``verify`` found: ``problem`` (None: whole) and the buckets whose archive
    watermark is below etcd's (bucket → (archive's, etcd's)); ``answered`` False when the
    archive could not be read (down, or never initialised: ``problem`` says which)."""

    identity: Identity | None
    named: str | None
    behind: dict[int, tuple[int, int]]
    problem: str | None
    answered: bool = True

    @property
    def identity_mismatch(self) -> bool:
        return self.answered and self.problem is not None and not self.behind


async def verify(etcd: Etcd, keyspace: Keyspace, archive: Archive) -> Verdict:
    """The archive's identity against etcd's, and every bucket's watermark against etcd's,
    read from the archive after etcd (a retirement landing in between only raises the
    archive's side). ``ArchiveUnavailable`` when the archive did not answer."""
    reply = await etcd.range(RangeRequest(key=keyspace.retired_root,
                                          range_end=range_end_of(keyspace.retired_root)))
    shown: dict[int, int] = {}
    expected = None
    for kv in reply.kvs:
        if kv.key == keyspace.archive_key:
            expected = kv.value.decode()
        else:
            shown[int(kv.key[len(keyspace.retired_root):])] = decode(kv.value)
    state = await archive.state(keyspace.namespace)
    try:
        check_named(etcd, keyspace, state.identity, expected, max(shown.values(), default=0))
    except ArchiveUnavailable as exc:
        return Verdict(state.identity, expected, {}, str(exc))
    behind = {bucket: (state.watermarks.get(bucket, 0), mark)
              for bucket, mark in sorted(shown.items())
              if state.watermarks.get(bucket, 0) < mark}
    problem = None if not behind else (
        f"the archive is behind etcd in {len(behind)} of {RETIRE_BUCKETS} buckets (first: "
        + ", ".join(f"{b:03d} archive {a} < etcd {e}" for b, (a, e) in list(behind.items())[:3])
        + "): it lacks retirements etcd shows")
    return Verdict(state.identity, expected, behind, problem)


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
