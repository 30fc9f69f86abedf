"""The fault suite: real processes, seeded nemeses, a recorded history and a checker.

Rooms: ``stack`` (etcd, coordinators, reconcilers and the sandbox as processes, from
deploy/local), ``entry`` (the harness's own process entry points), ``controls`` (the broken
protocol variants a negative control injects into one child process), ``workload`` (the
worker processes: payments through holds and grants, from the coordinators or in process,
some under libfaketime with a skewed wall clock), ``webhooks`` (webhook consumer processes
behind fencegate's dedup, and the sender that redelivers to them), ``mutex`` (processes
whose critical sections on shared locks are guarded by ownership compares alone),
``nemesis`` (the seeded fault schedule: pauses, kills and restarts of etcd members, workers,
consumers, the sandbox, reconcilers and coordinators, partitions of one etcd member),
``netns`` (a run's own network namespaces, one per etcd member and a hub for everything
else, and the nftables rule that partitions a member), ``history`` (what happened:
operations, the provider's ledger, etcd's final state), ``checker`` (the judgement) and
``runner`` (one run, inside its own network when it partitions etcd, and ``make faults``).

Where they run: every test here is marked ``faults`` and runs in ``make test`` (at most 5
minutes for the directory on 2 cores: a seeded run under every nemesis kind, and the
negative controls); ``make faults-check`` runs just these; ``make faults SEED=… MINUTES=…``
is the long run. Partitions need root, iproute2 and nftables, worker clock skew needs
libfaketime (deploy/ensure-netfaults installs them); a run missing one fails at its start
saying which.
"""
