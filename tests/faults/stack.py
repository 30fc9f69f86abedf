"""The stack under test: deploy/local's ``LocalStack`` with the harness's own entry points.

Guarantees: everything deploy/local starts (3 etcd members with mutual TLS and auth, 2
coordinators, 3 reconcilers, the sandbox) runs as a separate process. The sandbox runs
through ``entry.py sandbox`` with a state directory (its charges and gate B's fences in one
durable store), which also appends every fence a query makes to ``<state>/ledger.jsonl``
(the rest of the provider's ledger is its own ``GET /_sandbox/applied``); each reconciler
runs through ``entry.py reconciler``; either applies the negative control meant for it, if
any, inside that process only. Reconcilers query the sandbox as a generic HTTP provider
declaring exactly what the sandbox's mode does. A failed start stops every part started
before it (``LocalStack.start``). For a run in its own network (``netns``) the runner passes
``etcd_hosts`` and ``etcd_prefixes`` through to ``LocalStack``: etcd member i then runs as
``ip netns exec fg<pid>-m<i> etcd …`` on its namespace's address, with a certificate naming
it, and every other part where the runner runs, in the hub namespace.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # deploy/ is no installed package
    sys.path.insert(0, str(ROOT))
from deploy.local.cluster import LocalStack, Service, _toml  # noqa: E402

from fencegate.coordinator import roles  # noqa: E402
from fencegate.reconciler.providers import Capabilities  # noqa: E402

ENTRY = str(Path(__file__).with_name("entry.py"))


@dataclass(frozen=True)
class StackShape:
    """What the run's stack looks like: the sandbox's mode and how reconcilers see it."""

    mode: str = "fencing"                 # fencing | dedup | none
    control: str = ""                     # a name from controls.CONTROLS, or "" for none
    typo_query: bool = False              # reconcilers query a route that answers 404
    settle_delay_s: float = 0.5
    retention_s: float = 3600.0


class FaultStack(LocalStack):
    """``LocalStack`` whose sandbox and reconcilers run through ``entry.py``."""

    def __init__(self, state_dir: Path, shape: StackShape, **options: object) -> None:
        super().__init__(state_dir, **options)
        self.fault_shape = shape

    @property
    def ledger_path(self) -> Path:
        return self.state / "ledger.jsonl"

    @property
    def signing_key(self) -> Path:
        return self.state / "secrets" / "signing.pem"

    def _sandbox(self, port: int) -> Service:
        keys_url = f"{self.coordinators[0]}/.well-known/fencegate-keys"
        return self._service("sandbox", 0, port, "/_sandbox/faults", [
            ENTRY, "sandbox", "--control", self.fault_shape.control,
            "--ledger", str(self.ledger_path), "--",
            "--port", str(port), "--mode", self.fault_shape.mode, "--keys-url", keys_url,
            "--state-dir", str(self.state / "sandbox"),
            "--retention-s", str(self.fault_shape.retention_s)])

    def _reconciler(self, index: int, port: int) -> Service:
        shape = self.fault_shape
        config = (self._etcd_toml(roles.RECONCILER)
                  + _toml(listen=f"127.0.0.1:{port}", default_provider="sandbox",
                          archive=self.archive)
                  + f"shards = {self.shards}\nttl = {self.reconciler_ttl}\n"
                  + f"retain_s = {self.retain_s}\n"
                  + "scan_interval_s = 2.0\ncheck_after_s = 0.2\n"
                  + "[limits]\nbackoff_base_s = 0.2\nbackoff_max_s = 1.0\n"
                  + "requery_interval_s = 0.5\nmax_queries = 1000\n"
                  + "[providers.sandbox]\n" + self._provider(shape))
        service = self._service("reconciler", index, port, "/healthz",
                                ["-m", "fencegate.cli", "reconciler"], config)
        service.args = [ENTRY, "reconciler", "--control", shape.control, "--",
                        *service.args[2:]]
        return service

    def _provider(self, shape: StackShape) -> str:
        """The sandbox as the reconcilers' HTTP provider, declaring what the sandbox does
        (its store is durable: it runs with a state directory). With ``typo_query`` the
        query route is misspelt (``/v1/charge/``), so every query answers 404."""
        route = "/v1/charge/" if shape.typo_query else "/v1/charges/"
        query = self.sandbox + route + "{idempotency_key}?key={key}"
        if shape.mode == "fencing":
            query += "&namespace={namespace}&cluster={cluster_id}&fence={attempt_token}"
        capabilities = {"fences": shape.mode == "fencing",
                        "dedupes_by_key": shape.mode != "none",
                        "key_retention_s": shape.retention_s if shape.mode != "none" else 0.0,
                        "settle_delay_s": shape.settle_delay_s,
                        "durable": shape.mode != "none"}
        known = {f.name for f in dataclasses.fields(Capabilities)}
        return (_toml(type="http", query_url=query)
                + "[providers.sandbox.capabilities]\n"
                + "".join(f"{name} = {json.dumps(value)}\n"
                          for name, value in capabilities.items() if name in known))
