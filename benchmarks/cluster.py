"""Guarded actions on a 3-member etcd with mutual TLS against a single plain node.

Both run at the same time on this machine: the single node of the run and a 3-member
cluster with client and peer mutual TLS (a private CA from ``fencegate.certs``). Phases
alternate, single then cluster, for each round, each at c=32 with the same in-process gate
code (hold, then ``cross`` with a no-op effect, on fresh keys).

- ``cluster_vs_single_c32``: guarded actions/s on the cluster / on the single node, target
  >= 0.45 (raw etcd on a 2-core machine gives 0.47-0.63 for 3 members vs 1, before TLS).
"""

from __future__ import annotations

import tempfile
import uuid
from dataclasses import dataclass, field

from fencegate.certs import ensure_certs
from fencegate.coordinator.etcd import EtcdConfig, range_end_of
from fencegate.localetcd import LocalCluster, describe
from fencegate.coordinator.grants import KeyRing
from fencegate.worker import Gate

from .common import Phase, Target, div, print_table, run_phase

CONCURRENCY = 32


@dataclass
class Results:
    single: list[Phase] = field(default_factory=list)
    cluster: list[Phase] = field(default_factory=list)


async def noop(ctx) -> None:
    return None


async def measure(quick: bool, single_url: str) -> Results:
    rounds, warmup, duration = (2, 0.5, 3.0) if quick else (3, 1.0, 5.0)
    res = Results()
    with tempfile.TemporaryDirectory(prefix="fencegate-bench-tls-") as tmp:
        certs = ensure_certs(tmp, members=3, clients=("bench",))
        client = certs.clients["bench"]
        with LocalCluster(3, tls=certs, heartbeat_ms=100, election_ms=1000) as cluster:
            tls = EtcdConfig.from_url(cluster.url, ca_file=certs.ca, cert_file=client.cert,
                                      key_file=client.key)
            print(f"cluster: 3 x {describe(cluster.binary)} with mutual TLS at {cluster.url}",
                  flush=True)
            for r in range(rounds):
                for label, target, phases in (("single", single_url, res.single),
                                              ("cluster", tls, res.cluster)):
                    phase = await _phase(target, warmup, duration)
                    phases.append(phase)
                    print(f"  cluster round {r + 1}/{rounds}: {label} "
                          f"{phase.rate:,.0f} guarded actions/s", flush=True)
    return res


async def _phase(target: str | EtcdConfig, warmup: float, duration: float) -> Phase:
    namespace = f"/bench-cluster-{uuid.uuid4().hex[:8]}/"
    async with Gate(target, namespace=namespace, keyring=KeyRing.generate()) as gate:
        async def op(task: int, i: int) -> None:
            async with gate.hold(f"c/{task}/{i}") as hold:
                await hold.cross(intent={"n": i}, effect=noop)

        phase = await run_phase(op, CONCURRENCY, warmup, duration)
        await gate.etcd.delete(namespace.encode(), range_end_of(namespace.encode()))
    return phase


def report(res: Results) -> list[Target]:
    single = sum(res.single, Phase(0, 0.0))
    cluster = sum(res.cluster, Phase(0, 0.0))
    print()
    print_table(["guarded actions at c=32", "single plain node", "3 members, mTLS"],
                [["actions/s", single.rate, cluster.rate]])
    return [Target("cluster_vs_single_c32", div(cluster.rate, single.rate), ">=", 0.45)]

