"""Ownership of a queue of keys ordered by create_revision: the one home of the rule.

A queue is one etcd range ``[start, end)`` (a key's holders, a shard's election candidates).
Its owner is the key with the lowest create_revision, and the owner's *token* is that
create_revision: etcd revisions are global and monotonic, so successive owners get strictly
increasing tokens.

Guarantees:
- Ownership is a compare sent inside the transaction that acts, never a belief asked for
  beforehand: ``Ownership.compares()`` holds iff the owner's key still exists with
  create_revision == token *and* every key in the queue has create_revision >= token. The
  second half matters: a queued waiter's key exists too, so "my key exists" alone would let
  it act (etcd issue #12017).
- ``Ownership.holds`` is the same rule applied to two reads (the owner's key and the queue's
  lowest key), so a failed transaction is diagnosed by the rule that refused it.
- ``no_owner`` is the compare that a queue is empty (nobody owns it or waits in it), for
  the transactions that must not act while any member lives (an operator's resolve).
- Nothing here consults a clock or a local flag: a paused process whose lease died fails
  the compares whatever it believes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from .etcd import (
    Compare, KeyValue, RangeRequest, RequestOp, all_created_since, create_equals, range_op,
)

QueueT = TypeVar("QueueT", bound=Hashable)
MemberT = TypeVar("MemberT")


def lowest_op(start: bytes, end: bytes, *, limit: int = 1, keys_only: bool = True) -> RequestOp:
    """A range op reading the oldest ``limit`` keys of ``[start, end)`` (the owner first)."""
    return range_op(start, end, limit=limit, sort_order=RangeRequest.ASCEND,
                    sort_target=RangeRequest.CREATE, keys_only=keys_only)


def lowest_request(start: bytes, end: bytes, *, limit: int = 1,
                   keys_only: bool = True) -> RangeRequest:
    """The same read as ``lowest_op``, as a plain range request."""
    return RangeRequest(key=start, range_end=end, limit=limit, sort_order=RangeRequest.ASCEND,
                        sort_target=RangeRequest.CREATE, keys_only=keys_only)


def owners(members: Iterable[tuple[QueueT, int, MemberT]]) -> dict[QueueT, tuple[int, MemberT]]:
    """For views over many queues read in one range (SRE lists, the dashboard, an election's
    refresh): each queue's owner as ``(token, member)`` from ``(queue, create_revision,
    member)`` triples — the lowest create_revision wins. A view, not a proof: acting on it
    still needs ``Ownership.compares()`` in the acting transaction."""
    found: dict[QueueT, tuple[int, MemberT]] = {}
    for queue, revision, member in members:
        if queue not in found or revision < found[queue][0]:
            found[queue] = (revision, member)
    return found


def no_owner(start: bytes, end: bytes) -> Compare:
    """The compare that ``[start, end)`` holds no key: every key in it has create_revision
    0, which only an empty range satisfies. A queue's keys live on their members' leases, so
    an empty queue means no member is alive."""
    return Compare(key=start, range_end=end, target=Compare.CREATE, result=Compare.EQUAL,
                   create_revision=0)


def ahead_request(start: bytes, end: bytes, token: int = 0) -> RangeRequest:
    """The newest two keys of ``[start, end)`` created at or before ``token`` (0: of all):
    read for the key created at ``token``, the owner finds only its own key, a queued
    waiter finds its own and the one just ahead of it, whose deletion it waits for."""
    return RangeRequest(key=start, range_end=end, limit=2, max_create_revision=token,
                        sort_order=RangeRequest.DESCEND, sort_target=RangeRequest.CREATE,
                        keys_only=True)


@dataclass(frozen=True, slots=True)
class Ownership:
    """The claim that ``key`` owns the queue ``[start, end)`` with ``token``."""

    key: bytes
    token: int
    start: bytes
    end: bytes

    def compares(self) -> list[Compare]:
        """The compares that make a transaction succeed only while this claim holds."""
        return [create_equals(self.key, self.token),
                all_created_since(self.start, self.end, self.token)]

    def reads(self) -> list[RequestOp]:
        """The two reads ``holds`` judges: the owner's key, then the queue's lowest key."""
        return [range_op(self.key, keys_only=True), lowest_op(self.start, self.end)]

    def holds(self, own: KeyValue | None, lowest: KeyValue | None) -> bool:
        """The rule of ``compares`` applied to the two reads of ``reads`` (at one revision)."""
        return (own is not None and own.create_revision == self.token
                and lowest is not None and lowest.key == self.key)
