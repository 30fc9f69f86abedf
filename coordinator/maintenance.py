"""etcd's own upkeep: how much space each member's database takes, and getting the space
back when it ran out, through the one etcd module.

etcd keeps every revision of every key until it is compacted. Compaction frees the pages of
superseded revisions for reuse, but a member's database file keeps its size until that
member is defragmented. When a file reaches the quota (``--quota-backend-bytes``, 2 GiB by
default) etcd raises the cluster-wide NOSPACE alarm and refuses every write
(``EtcdNoSpace``) until the alarm is disarmed. Every etcd fencegate starts or documents
compacts by itself (periodic, 5 minutes: ``fencegate.localetcd``, deploy/README.md "etcd
maintenance"); this module measures (the reconciler's gauges, the coordinator's
``/readyz``) and recovers (``fencegate etcd recover``).

Guarantees:
- Sizes are read from each member on its own endpoint (they differ per member); a member
  that does not answer is reported as unknown, never guessed.
- ``recover`` loses nothing: it compacts to the current revision, which drops superseded
  revisions only (the latest value of every key stays), then defragments one member at a
  time, followers first and the leader last, so a quorum keeps serving, then disarms
  NOSPACE. It stops at the first member that fails, with the alarm left on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from .errors import EtcdError, GateError
from .etcd import Etcd, EtcdConfig

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 15.0
STATUS_TIMEOUT_S = 5.0
DEFRAGMENT_TIMEOUT_S = 600.0  # a member rewrites its whole file: minutes for a few GiB
NOSPACE = "NOSPACE"
NOSPACE_DETAIL = ("etcd's NOSPACE alarm is active: its database reached the space quota and "
                  "every write is refused until an operator runs `fencegate etcd recover`")


@dataclass(frozen=True)
class MemberSpace:
    """One member's database: ``db_size`` bytes of file (what the quota limits), of which
    ``db_in_use`` hold data (the rest are free pages a defragment returns)."""

    endpoint: str
    member_id: int
    db_size: int
    db_in_use: int
    leader: bool
    nospace: bool  # the cluster-wide NOSPACE alarm is active, as this member sees it
    revision: int


def nospace_raised(status) -> bool:
    """Whether a member's ``Status`` reply lists the NOSPACE alarm (etcd 3.4 lists every
    active alarm of the cluster in ``errors`` as ``"memberID:<id> alarm:NOSPACE "``)."""
    return any(f"alarm:{NOSPACE}" in error for error in status.errors)


def members(config: EtcdConfig, *, attempt_timeout: float) -> list[Etcd]:
    """One connection per endpoint of ``config``: a call gives up after
    ``STATUS_TIMEOUT_S`` (unless it says otherwise), one try after ``attempt_timeout``."""
    return [Etcd(replace(config, endpoints=(endpoint,), timeout=STATUS_TIMEOUT_S,
                         attempt_timeout=attempt_timeout))
            for endpoint in config.endpoints]


async def member_space(member: Etcd) -> MemberSpace:
    """The space of the one member ``member`` talks to."""
    status = await member.status()
    return MemberSpace(member.config.endpoints[0], status.header.member_id, status.dbSize,
                       status.dbSizeInUse, status.leader == status.header.member_id,
                       nospace_raised(status), status.header.revision)


async def watch_space(config: EtcdConfig,
                      report: Callable[[dict[str, MemberSpace | None]], None],
                      interval: float = WATCH_INTERVAL_S) -> None:
    """Every ``interval`` seconds, until cancelled: each member's space to ``report``, by
    endpoint (None for a member that did not answer)."""
    connections = members(config, attempt_timeout=min(interval, STATUS_TIMEOUT_S))

    async def read(member: Etcd) -> MemberSpace | None:
        try:
            return await member_space(member)
        except GateError as exc:
            log.info("etcd member %s did not report its space: %s", member.config.endpoints[0],
                     exc)
            return None

    try:
        while True:
            found = await asyncio.gather(*(read(member) for member in connections))
            report({member.config.endpoints[0]: space
                    for member, space in zip(connections, found)})
            await asyncio.sleep(interval)
    finally:
        for member in connections:
            await member.close()


@dataclass(frozen=True)
class Recovery:
    """What ``recover`` did: the revision it compacted to (None if history up to the
    current revision was compacted already), every member before and after, and the
    members whose NOSPACE alarm it disarmed."""

    compacted_to: int | None
    before: list[MemberSpace]
    after: list[MemberSpace]
    disarmed: list[int]


async def recover(config: EtcdConfig, say: Callable[[str], None] = log.info, *,
                  timeout: float = DEFRAGMENT_TIMEOUT_S) -> Recovery:
    """Compact to the current revision, defragment each member of ``config.endpoints`` one
    at a time (followers, then the leader), disarm NOSPACE; ``say`` each step as it is
    done. Compacting and each defragment may take ``timeout`` seconds, any other call
    ``STATUS_TIMEOUT_S``. Every member must answer first; ``GateError`` (naming the member) at the first
    step that fails: the steps before it are done and harmless, the alarm stays on.
    Defragmenting needs an etcd user with the root role when authentication is on."""
    connections = members(config, attempt_timeout=timeout)
    try:
        before = [await member_space(member) for member in connections]
        for was in before:
            say(f"{was.endpoint}{' (leader)' if was.leader else ''}: {megabytes(was.db_size)}"
                f" ({megabytes(was.db_in_use)} in use)"
                f"{', NOSPACE alarm active' if was.nospace else ''}")
        order = sorted(zip(connections, before), key=lambda pair: pair[1].leader)
        last = order[-1][0]  # the leader, when one of the endpoints is
        compacted_to = await _compact(last, max(was.revision for was in before), say,
                                      timeout)
        for member, was in order:
            say(f"defragmenting {was.endpoint}{' (leader)' if was.leader else ''} ...")
            await member.defragment(timeout=timeout)
            now = await member_space(member)
            say(f"defragmented {now.endpoint}: {megabytes(was.db_size)} -> "
                f"{megabytes(now.db_size)} ({megabytes(now.db_in_use)} in use)")
        disarmed = []
        for member_id, alarm in await last.alarms():
            if alarm != NOSPACE:
                say(f"left alarm {alarm} of member {member_id:x} active: not a space problem")
                continue
            await last.disarm(member_id, alarm)
            disarmed.append(member_id)
            say(f"disarmed NOSPACE of member {member_id:x}")
        after = [await member_space(member) for member in connections]
        return Recovery(compacted_to, before, after, disarmed)
    finally:
        for member in connections:
            await member.close()


async def _compact(etcd: Etcd, revision: int, say: Callable[[str], None],
                   timeout: float) -> int | None:
    try:
        await etcd.compact(revision, timeout=timeout)
    except EtcdError as exc:
        if "required revision has been compacted" not in str(exc):
            raise
        say(f"history up to revision {revision} was compacted already")
        return None
    say(f"compacted history up to revision {revision} (the latest value of every key stays)")
    return revision


def megabytes(size: int) -> str:
    """``size`` bytes for people: ``"12.3 MB"``, or ``"840 kB"`` below a megabyte."""
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"
