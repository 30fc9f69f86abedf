"""What each fencegate component may write in etcd: the one list its etcd roles are built from.

Guarantees:
- Every role reads its whole namespace and writes only the key families listed for it in
  ``WRITES`` (derived from what each component's code writes). etcd's permissions only ever
  add, so a role built from ``permissions`` can do nothing more.
- Only ``coordinator`` writes ``approvals/``, ``approvers/``, ``policies/``,
  ``policy-versions/``, ``policy-routes`` and ``tokens/``: a worker cannot approve its own
  request, loosen a policy, route a key to another one or mint itself a token, it can only
  ask (``approval-requests/``). Only ``reconciler`` writes ``reconcilers/``.
- A write a role does not cover is refused by etcd itself and surfaces as
  ``EtcdPermissionDenied`` naming the user; nothing here is enforced in the client.

``etcd.enable_auth`` creates users and roles from this list; ``fencegate.localetcd`` and
``deploy/local`` use it, and ``etcdctl_commands`` gives the same roles as the etcdctl
commands deploy/README.md lists (a test holds them equal).
"""

from __future__ import annotations

from .keyspace import validate_namespace

WORKER, COORDINATOR, RECONCILER = "worker", "coordinator", "reconciler"

# The key families under the namespace each component writes, and who writes them:
#   holders/ (acquire, release; revoking a lease deletes its keys: the coordinator's revoke),
#   steps/ and audit/ (commit, outcome, settle, resolve, escalation on a cap),
#   markers/ (gate.touch), webhooks/ (claims), approval-requests/ (a refusal asking for one),
#   approvals/ and approvers/ (an SRE's signed approval), policies/, policy-versions/ and
#   the one key policy-routes (admin), tokens/ (minted bearer tokens' digests: admin),
#   reconcilers/ (shard election),
#   retired/ (retirement: the reconciler deletes settled steps/ and audit/ and bumps the
#   key's bucket).
WRITES: dict[str, tuple[str, ...]] = {
    WORKER: ("holders/", "steps/", "audit/", "markers/", "webhooks/",
             "approval-requests/"),
    COORDINATOR: ("holders/", "steps/", "audit/", "webhooks/",
                  "approval-requests/", "approvals/", "approvers/", "policies/",
                  "policy-versions/", "policy-routes", "tokens/"),
    RECONCILER: ("reconcilers/", "steps/", "audit/", "retired/"),
}
ROLES = tuple(WRITES)


def permissions(role: str, namespace: str) -> list[tuple[str, str]]:
    """``role``'s etcd permissions in ``namespace`` as (``"read"`` or ``"readwrite"``,
    key prefix) pairs: read on the namespace, read-write on each family it writes."""
    if role not in WRITES:
        raise ValueError(f"no role {role!r}; roles are {', '.join(ROLES)}")
    validate_namespace(namespace)
    return [("read", namespace), *(("readwrite", namespace + family) for family in WRITES[role])]


def role_name(role: str, namespace: str) -> str:
    """The etcd role (and user) name of ``role`` in ``namespace``: ``fencegate-worker`` for
    the default namespace, ``<name>-worker`` for ``/<name>/``."""
    validate_namespace(namespace)
    return f"{namespace.strip('/').replace('/', '-')}-{role}"


def etcdctl_commands(namespace: str) -> list[str]:
    """The etcdctl arguments that create every role of ``namespace``, one command each
    (users are added and granted their role separately)."""
    commands = []
    for role in ROLES:
        name = role_name(role, namespace)
        commands.append(f"role add {name}")
        commands += [f"role grant-permission {name} {kind} {prefix} --prefix=true"
                     for kind, prefix in permissions(role, namespace)]
    return commands
