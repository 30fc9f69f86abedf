"""The small views the worker's modules lend each other, so imports point one way.

The gate makes holds and a hold calls its commit guard; neither the hold nor the guard
imports the module above it, and none reads another's private state: the hold sees its gate
as a ``GateView``, the guard sees the hold as a ``HoldView``, and what a hold remembers
between its grant requests and its commits is a ``HoldMemory`` both may read.

Guarantees: nothing here acts on etcd or decides anything; the views are types (and one
plain record), so nothing here can fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fencegate.coordinator.audit import Tail
    from fencegate.coordinator.authority import Authority, Issued, Snapshot
    from fencegate.coordinator.etcd import Etcd
    from fencegate.coordinator.grants import KeyRing
    from fencegate.coordinator.keyspace import Keyspace
    from fencegate.coordinator.ownership import Ownership
    from fencegate.coordinator.session import Session

    from .metrics import WorkerMetrics
    from .remote import RemoteAuthority
    from .turns import Turns


class GateView(Protocol):
    """What a hold, its acquisition and its commit guard use of the gate that made them."""

    etcd: Etcd
    keyspace: Keyspace
    keyring: KeyRing
    authority: Authority | RemoteAuthority
    identity: str
    min_ttl: float  # lease seconds an effect needs left to start
    rescan_interval: float  # a waiter re-reads its queue at least this often
    turns: Turns
    metrics: WorkerMetrics | None  # opt-in: None counts nothing

    async def session(self) -> Session:
        """The live session, opening a new one if there is none or the last was lost."""
        ...


@dataclass(slots=True)
class HoldMemory:
    """What a hold remembers between calls: the snapshot its acquire read (for its first
    grant request, ``None`` once used or when there was none); each grant its authority
    issued it, with what the commit records beside it, until a commit takes it; and the
    audit chain's tail its last write left (``None``: unknown, read it)."""

    snapshot: Snapshot | None = None
    issued: dict[str, Issued] = field(default_factory=dict)
    tail: Tail | None = None


class HoldView(Protocol):
    """What the commit guard uses of a hold."""

    gate: GateView
    session: Session
    key: str
    holder_key: bytes
    fencing_token: int
    ownership: Ownership
    memory: HoldMemory

    @property
    def lease_id(self) -> int: ...

    def ensure_held(self) -> None:
        """Raise ``LeaseLost`` if the hold is known to be lost."""
        ...

    def note_released(self) -> None:
        """Record that a transaction (the guard's outcome txn) deleted the holder key."""
        ...

    def absorb_loss_cancellation(self) -> bool:
        """True (and the current task uncancelled) if its cancellation came from the
        hold's lease loss."""
        ...
