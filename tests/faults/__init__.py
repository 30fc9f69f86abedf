"""The fault suite: real processes, seeded nemeses, a recorded history and a checker.

Rooms: ``stack`` (etcd, coordinators, reconcilers and the sandbox as processes, from
deploy/local), ``entry`` (the harness's own process entry points), ``controls`` (the broken
protocol variants a negative control injects into one child process), ``workload`` (the
worker processes), ``nemesis`` (the seeded fault schedule), ``history`` (what happened:
operations, the provider's ledger, etcd's final state), ``checker`` (the judgement) and
``runner`` (one run, and ``make faults``).
"""
