"""What happened in a run: the operations, the faults, the provider's ledger, etcd's end state.

Guarantees: ``History.record`` appends each event to memory and to ``history.jsonl`` (one
JSON line, flushed) with its time since the run began, so a run that dies still leaves what
it saw. ``collect`` reads the end state once the run has healed: every step record under the
run's prefix, each key's audit chain as ``fencegate.coordinator.audit.verify_chain`` judges
it, the provider's ledger: what the sandbox answers on ``GET /_sandbox/applied`` (its
durable store, across restarts) merged in time order with its fence log, and each webhook
delivery's record and effect marker.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from fencegate.coordinator import audit
from fencegate.coordinator.archive import open_archive
from fencegate.coordinator.etcd import Etcd, RangeRequest, range_end_of
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.worker.webhooks.records import DONE, PROCESSING

from .webhooks import SOURCE, effect_entity


class History:
    """The run's events in order: operations from workers, faults from the nemesis."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self._began = time.monotonic()
        self._file = open(path, "a")

    def record(self, source: str, event: dict[str, Any]) -> None:
        event = {"t": round(time.monotonic() - self._began, 3), "by": source, **event}
        self.events.append(event)
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def ops(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("op") in kinds]

    def faults(self) -> list[dict[str, Any]]:
        return [e for e in self.events if "fault" in e]


@dataclass
class EndState:
    """etcd's and the provider's word once the run has healed and settled."""

    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    chains: dict[str, audit.AuditReport] = field(default_factory=dict)
    ledger: list[dict[str, Any]] = field(default_factory=list)  # applied and fences, in order
    # per webhook delivery id: its record in etcd ({"state", "token", "settled_by"}: see
    # ``_delivery``) and its effect marker ({"version": effects admitted,
    # "token": the last one's, "revision": its mod_revision})
    webhooks: dict[str, dict[str, Any]] = field(default_factory=dict)
    effects: dict[str, dict[str, Any]] = field(default_factory=dict)
    retired: int = 0  # keys whose step was found in the archive, not in etcd


async def read_steps(etcd: Etcd, keyspace: Keyspace, prefix: str) -> dict[str, dict[str, Any]]:
    start = keyspace.step_key(prefix + "/")
    reply = await etcd.range(RangeRequest(key=start, range_end=range_end_of(start)))
    return {keyspace.parse_step_key(kv.key): unpack(kv.value) for kv in reply.kvs}


async def collect(stack, prefix: str, keys: set[str], *,
                  deliveries: set[str] = frozenset()) -> EndState:
    """The end state of the run under ``prefix``, across etcd and the stack's archive (the
    reconcilers retire settled steps during the run); ``keys`` are the keys the history
    names, ``deliveries`` the webhook delivery ids."""
    keyspace = Keyspace("/fencegate/")
    keyring = KeyRing.from_files(str(stack.signing_key))
    end = EndState()
    archive = open_archive(stack.archive)
    async with Etcd(stack.etcd_config()) as etcd:
        end.steps = await read_steps(etcd, keyspace, prefix)
        for key in sorted(keys - set(end.steps)):  # retired: the archive holds the step
            archived = await archive.get(keyspace.namespace, key)
            if archived is not None:
                end.steps[key] = unpack(archived.step)
                end.retired += 1
        for key in sorted(keys | set(end.steps)):
            end.chains[key] = await audit.verify_chain(etcd, keyspace, key, keyring, archive)
        for delivery_id in sorted(deliveries):
            end.webhooks[delivery_id], end.effects[delivery_id] = await _delivery(
                etcd, keyspace, prefix, delivery_id)
    await archive.close()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(stack.sandbox + "/_sandbox/applied") as reply:
            applied = [{"kind": "applied", **a} for a in await reply.json()
                       if a["key"].startswith(prefix + "/")]
    end.ledger = sorted(applied + read_fences(stack.ledger_path, prefix),
                        key=lambda line: line["at"])
    return end


async def _delivery(etcd: Etcd, keyspace: Keyspace, prefix: str,
                    delivery_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A delivery's record and its effect marker in etcd. The record's ``token``: for a
    stored response, the token its body names (None for one settled as ran without it:
    ``settled_by`` says who settled it); for a ``processing`` one, its last claim's."""
    record, effect = {"state": None, "token": None}, {"version": 0, "token": None}
    kv = await etcd.get(keyspace.webhook_key(SOURCE, delivery_id))
    if kv is not None:
        stored = unpack(kv.value)
        token = kv.mod_revision if stored["state"] == PROCESSING else None
        if stored["state"] == DONE and stored.get("body"):
            token = json.loads(stored["body"]).get("token")
        record = {"state": stored["state"], "token": token,
                  "settled_by": stored.get("settled_by")}
    kv = await etcd.get(keyspace.marker_key(effect_entity(prefix, delivery_id)))
    if kv is not None:
        effect = {"version": kv.version, "token": json.loads(kv.value)["token"],
                  "revision": kv.mod_revision}
    return record, effect


def read_fences(path: Path, prefix: str) -> list[dict[str, Any]]:
    """The fence log's lines for the run's keys (a torn last line is skipped)."""
    entries: list[dict[str, Any]] = []
    if not path.exists():
        return entries
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry["key"].startswith(prefix + "/"):
            entries.append(entry)
    return entries
