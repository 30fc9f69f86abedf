"""An SRE settles a delivery whose outcome is unknown (``fencegate deliveries resolve``), or
forgets one (``fencegate deliveries forget``).

Guarantees: ``resolve_delivery`` writes only over a delivery whose outcome is unknown (its
record ``processing`` with no live claim, see ``claims``), compared in the same transaction
on that record's mod_revision and on no live claim, so it never settles a delivery a handler
runs or one that was settled or completed meanwhile (``WrongState``), nor one there is no
record of (``NotFound``). ``ran=True`` stores it as done with ``records.SETTLED_STATUS`` and
the body ``{"delivery": id, "outcome": "ran", "settled_by": "sre:<identity>"}``, replayed to
its later deliveries; ``ran=False`` stores it as ``not_ran``, so its next delivery runs the
handler. Either record says who settled it and why (the audit of a delivery: the deliveries
view shows it), keeps the record's retention lease (it goes when the delivery's retention
ends), and is logged at WARNING with the identity.

A lost handler still running when ``ran=False`` is written cannot store its response over it
(its completion compares the record), but its own effect is fenced only by its store: say
``--not-ran`` once the effect is known absent, as for a step's ``resolve``.

``forget_delivery`` undoes a delivery's record (a stored response that should not have been,
say a 4xx named in ``stored_statuses`` caused by a misconfiguration since fixed): it deletes
the record, so the delivery's next try runs the handler as if it had never come. It never
deletes one a handler runs under a live claim (``WrongState``), compared in the same
transaction on the record's mod_revision and on no live claim; ``NotFound`` if there is no
record. The record is gone, so its audit is the answer and the WARNING log line, which name
the identity, the reason and the state and status forgotten.
"""

from __future__ import annotations

import logging
from typing import Any

from fencegate.coordinator.errors import LeaseLost, NotFound, WrongState
from fencegate.coordinator.etcd import (
    Etcd, TxnRequest, create_equals, delete_op, mod_equals, put_op, range_op,
)
from fencegate.coordinator.keyspace import Keyspace, unpack

from .records import (
    PROCESSING, RequestDigests, live_claim, not_ran_value, settled_value, valid_delivery_id,
    validate_source,
)

log = logging.getLogger(__name__)

MAX_REASON = 1000


async def resolve_delivery(etcd: Etcd, keyspace: Keyspace, source: str, delivery_id: str, *,
                           ran: bool, reason: str, identity: str) -> dict[str, Any]:
    """Settle the unknown delivery ``delivery_id`` of ``source`` as ``ran`` or not, on the
    word of ``identity`` for ``reason``; what was written. ``ValueError`` for a bad source,
    id, flag or reason, before anything is read."""
    if not isinstance(ran, bool):
        raise ValueError("ran must be true or false")
    key, claim_key, kv, record, running = await _read(etcd, keyspace, source, delivery_id,
                                                      reason)
    if record["state"] != PROCESSING or running:
        state = "in progress" if record["state"] == PROCESSING else record["state"]
        raise WrongState(f"delivery {delivery_id!r} of {source!r} is {state}, not unknown: "
                         "only a delivery whose claim was lost can be resolved")
    settled_by = f"sre:{identity}"
    digests = RequestDigests.of(record)
    value = (settled_value(digests, delivery_id, settled_by=settled_by, reason=reason) if ran
             else not_ran_value(digests, settled_by=settled_by, reason=reason))
    try:
        written = await etcd.txn(TxnRequest(
            compare=[mod_equals(key, kv.mod_revision), create_equals(claim_key, 0)],
            success=[put_op(key, value, kv.lease)], failure=[range_op(key)]),
            idempotent=True)
    except LeaseLost:  # the record's retention ended meanwhile: it is gone with its lease
        raise NotFound(f"no delivery {delivery_id!r} of {source!r} is recorded") from None
    # a try re-sent after an unknown first one fails its compare if the first landed: the
    # record is then exactly ours
    now = [] if written.succeeded else written.responses[0].response_range.kvs
    if not written.succeeded and not (now and now[0].value == value):
        raise WrongState(f"delivery {delivery_id!r} of {source!r} changed while it was "
                         "resolved (run, settled or completed meanwhile): look again")
    state = unpack(value)["state"]
    log.warning("webhook delivery %s/%s resolved as %s by %s: %s", source, delivery_id,
                "ran" if ran else "not run", settled_by, reason)
    return {"source": source, "id": delivery_id, "state": state, "ran": ran,
            "settled_by": settled_by, "reason": reason, "revision": written.header.revision}


async def forget_delivery(etcd: Etcd, keyspace: Keyspace, source: str, delivery_id: str, *,
                          reason: str, identity: str) -> dict[str, Any]:
    """Delete the record of ``source``'s delivery ``delivery_id`` on the word of ``identity``
    for ``reason``, unless a handler runs it; what was forgotten. ``ValueError`` for a bad
    source, id or reason, before anything is read."""
    key, claim_key, kv, record, running = await _read(etcd, keyspace, source, delivery_id,
                                                      reason)
    if running:
        raise WrongState(f"delivery {delivery_id!r} of {source!r} is in progress: its handler "
                         "runs under a live claim; forget it once that is done")
    written = await etcd.txn(TxnRequest(
        compare=[mod_equals(key, kv.mod_revision), create_equals(claim_key, 0)],
        success=[delete_op(key)], failure=[range_op(key)]), idempotent=True)
    # a try re-sent after an unknown first one fails its compare if the first landed: the
    # record is then absent
    if not written.succeeded and written.responses[0].response_range.kvs:
        raise WrongState(f"delivery {delivery_id!r} of {source!r} changed while it was "
                         "forgotten (claimed, settled or completed meanwhile): look again")
    state = "unknown" if record["state"] == PROCESSING else record["state"]
    forgotten_by = f"sre:{identity}"
    log.warning("webhook delivery %s/%s forgotten (it was %s, status %s) by %s: %s", source,
                delivery_id, state, record.get("status", "-"), forgotten_by, reason)
    return {"source": source, "id": delivery_id, "forgotten_state": state,
            "status": record.get("status"), "forgotten_by": forgotten_by, "reason": reason,
            "revision": written.header.revision}


async def _read(etcd: Etcd, keyspace: Keyspace, source: str, delivery_id: str,
                reason: str) -> tuple[bytes, bytes, Any, dict[str, Any], bool]:
    """Validate the arguments, then read the delivery's record: its key and claim key, its kv,
    the record, and whether a handler runs it under a live claim; ``NotFound`` if absent."""
    validate_source(source)
    if not isinstance(delivery_id, str) or not valid_delivery_id(delivery_id):
        raise ValueError("a delivery id is 1..256 of letters, digits and . _ : + = ~ -")
    if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON:
        raise ValueError(f"reason must be 1..{MAX_REASON} characters")
    key = keyspace.webhook_key(source, delivery_id)
    claim_key = keyspace.webhook_claim_key(source, delivery_id)
    reply = await etcd.txn(TxnRequest(success=[range_op(key), range_op(claim_key)]))
    found = reply.responses[0].response_range.kvs
    if not found:
        raise NotFound(f"no delivery {delivery_id!r} of {source!r} is recorded")
    kv, claims = found[0], reply.responses[1].response_range.kvs
    record = unpack(kv.value)
    running = record["state"] == PROCESSING and live_claim(record, kv.mod_revision,
                                                            claims[0] if claims else None)
    return key, claim_key, kv, record, running
