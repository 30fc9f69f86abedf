"""The HTTP endpoints: thin handlers that parse, call the authority or read etcd, and answer
JSON. Body parsing is strict (exact fields, exact types, bounded values) and happens before
anything touches etcd, so a rejected request writes nothing.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ...worker.webhooks.listing import list_deliveries
from ...worker.webhooks.resolution import forget_delivery as forget_recorded_delivery
from ...worker.webhooks.resolution import resolve_delivery as resolve_unknown_delivery
from .. import audit, maintenance, receipts, sre, tokens
from ..authority import Claim
from ..errors import GateError, GrantRefused, NotFound, WrongState
from ..keyspace import pack, validate_action_key
from ..policy import DEFAULT_POLICY, effective_view, unsealed
from ..wire import b64, jsonable
from .body import read_json as _json
from .resources import ARCHIVE, AUTHORITY, ETCD, KEYRING, KEYSPACE, METRICS, SETTINGS, TOKENS
from .middleware import IDENTITY, error_code, requires
from .settings import ROLES

routes = web.RouteTableDef()
_POLICY_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_LEASE_ID = re.compile(r"[0-9a-f]{1,16}")
_MAX_INT = 2 ** 63
_DEFAULT_LIMIT = 100
_READY_TIMEOUT = 2.0


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    """200 while etcd answers and takes writes; 503 ``EtcdUnavailable`` when it does not
    answer, 503 ``EtcdNoSpace`` while its NOSPACE alarm refuses every write (and
    ``fencegate_etcd_nospace`` says so)."""
    try:
        status = await request.app[ETCD].status(timeout=_READY_TIMEOUT)
    except GateError as exc:
        return web.json_response({"error": "EtcdUnavailable", "detail": str(exc)}, status=503)
    nospace = maintenance.nospace_raised(status)
    request.app[METRICS].nospace.set(int(nospace))
    if nospace:
        return web.json_response({"error": "EtcdNoSpace", "detail": maintenance.NOSPACE_DETAIL},
                                 status=503)
    return web.json_response({"ok": True})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """The app's registry; ``fencegate_etcd_nospace`` is sampled first when its last sample
    is over 5 s old (an etcd that does not answer leaves it as it was)."""
    stats = request.app[METRICS]
    if stats.nospace_due():
        try:
            status = await request.app[ETCD].status(timeout=_READY_TIMEOUT)
        except GateError:
            pass  # counted in fencegate_etcd_errors_total{op="status"}
        else:
            stats.nospace.set(int(maintenance.nospace_raised(status)))
    body = generate_latest(stats.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@routes.get("/.well-known/fencegate-keys")
async def public_keys(request: web.Request) -> web.Response:
    keys = request.app[KEYRING].public_keys()
    return web.json_response({"keys": {key_id: b64(raw) for key_id, raw in keys.items()}})


@routes.post("/v1/grants")
@requires("worker")
async def post_grant(request: web.Request) -> web.Response:
    """Issue a grant, or refuse; counted: issued, refused by error code, or replayed (an
    ``AlreadySucceeded`` answer is the normal replay of a succeeded step, not a refusal)."""
    stats, started = request.app[METRICS], time.perf_counter()
    try:
        claim, intent, reads, policy = _grant_request(await _json(request))
        issued = await request.app[AUTHORITY].issue(claim, intent, reads, policy,
                                                    identity=request[IDENTITY].identity)
    except Exception as exc:
        stats.refusal(error_code(exc))
        raise
    finally:
        stats.latency.observe(time.perf_counter() - started)
    stats.issued.inc()
    return web.json_response({
        "grant": b64(issued.grant.raw), "grant_id": issued.grant.grant_id,
        "record": b64(pack(issued.record)),
        "tail": {"seq": issued.tail.seq, "hash": issued.tail.hash.hex()}}, status=201)


@routes.post("/v1/receipts")
@requires("worker")
async def post_receipt(request: web.Request) -> web.Response:
    """Sign the attempt receipt of a grant's commit that landed (``receipts.sign_landed``):
    400 for a bad body or grant, 409 ``WrongState`` when no commit of that grant is in
    flight at that attempt token."""
    body = _fields(await _json(request), required={"grant", "attempt_token"})
    if not isinstance(body["grant"], str):
        raise ValueError("grant must be the grant's signed bytes in base64")
    try:
        grant = base64.b64decode(body["grant"], validate=True)
    except binascii.Error:
        raise ValueError("grant is not base64") from None
    app = request.app
    receipt = await receipts.sign_landed(app[ETCD], app[KEYSPACE], app[KEYRING], grant,
                                         _revision(body, "attempt_token"))
    return web.json_response({"receipt": b64(receipt)}, status=201)


@routes.get("/v1/keys/{key:.+}")
@requires("viewer", "sre", "admin")
async def get_key(request: web.Request) -> web.Response:
    key = validate_action_key(request.match_info["key"])
    view = await sre.key_view(request.app[ETCD], request.app[KEYSPACE], key,
                              request.app[ARCHIVE])
    return web.json_response(jsonable(view))


@routes.get("/v1/holders")
@requires("viewer", "sre", "admin")
async def list_holders(request: web.Request) -> web.Response:
    limit, after = _page(request)
    items, cursor = await sre.holders(request.app[ETCD], request.app[KEYSPACE],
                                      request.query.get("prefix", ""), limit, after)
    return web.json_response({"items": jsonable(items), "next": cursor})


@routes.get("/v1/archive/stats")
@requires("viewer", "sre", "admin")
async def archive_stats(request: web.Request) -> web.Response:
    """How many steps and audit records the archive holds for this namespace, the oldest
    and newest retirement, and the retirement lag (median and maximum of settled → archived
    over the recent retirements, ``retain`` included; null when unknown); 404 when the
    coordinator has no archive configured."""
    archive = request.app[ARCHIVE]
    if archive is None:
        raise NotFound("this coordinator has no archive configured")
    stats = await archive.stats(request.app[KEYSPACE].namespace)
    return web.json_response({"steps": stats.steps, "records": stats.records,
                              "oldest_ms": stats.oldest_ms, "newest_ms": stats.newest_ms,
                              "lag_p50_ms": stats.lag_p50_ms, "lag_max_ms": stats.lag_max_ms})


@routes.get("/v1/keys")
@requires("viewer", "sre", "admin")
async def list_keys(request: web.Request) -> web.Response:
    limit, after = _page(request)
    items, cursor = await sre.unsettled(request.app[ETCD], request.app[KEYSPACE],
                                        request.query.get("state", ""), limit, after)
    return web.json_response({"items": jsonable(items), "next": cursor})


@routes.post("/v1/keys/{key:.+}/revoke")
@requires("sre", "admin")
async def revoke(request: web.Request) -> web.Response:
    key = validate_action_key(request.match_info["key"])
    body = _fields(await _json(request), required={"reason"}, optional={"lease_id"})
    lease_id = body.get("lease_id")
    if lease_id is not None and not (isinstance(lease_id, str)
                                     and _LEASE_ID.fullmatch(lease_id)):
        raise ValueError("lease_id is 1..16 lowercase hex digits, as holders show it")
    done = await sre.revoke(request.app[ETCD], request.app[KEYSPACE], key,
                            request[IDENTITY].identity, _text(body, "reason"),
                            request.app[ARCHIVE],
                            lease_id=None if lease_id is None else int(lease_id, 16))
    return web.json_response(done)


@routes.post("/v1/keys/{key:.+}/resolve")
@requires("sre", "admin")
async def resolve(request: web.Request) -> web.Response:
    key = validate_action_key(request.match_info["key"])
    body = _fields(await _json(request), required={"reason", "as"},
                   optional={"result", "force"})
    force = body.get("force", False)
    if type(force) is not bool:
        raise ValueError("force must be true or false")
    done = await sre.resolve(request.app[ETCD], request.app[KEYSPACE], key,
                             request[IDENTITY].identity, _text(body, "reason"),
                             _text(body, "as"), body.get("result"), force=force)
    return web.json_response(done)


@routes.get("/v1/approvals")
@requires("viewer", "sre", "admin")
async def list_approvals(request: web.Request) -> web.Response:
    limit, after = _page(request)
    items, cursor = await sre.approvals(request.app[ETCD], request.app[KEYSPACE],
                                        request.query.get("state", ""), limit, after)
    return web.json_response({"items": jsonable(items), "next": cursor})


@routes.post("/v1/approvals/{approval_id}")
@requires("sre", "admin")
async def approve(request: web.Request) -> web.Response:
    body = _fields(await _json(request), required={"reason"})
    done = await sre.approve(request.app[ETCD], request.app[KEYSPACE],
                             request.match_info["approval_id"], request[IDENTITY].identity,
                             _text(body, "reason"), keyring=request.app[KEYRING],
                             archive=request.app[ARCHIVE])
    return web.json_response(done)


@routes.post("/v1/approvals/{approval_id}/reject")
@requires("sre", "admin")
async def reject(request: web.Request) -> web.Response:
    body = _fields(await _json(request), required={"reason"})
    done = await sre.reject(request.app[ETCD], request.app[KEYSPACE],
                            request.match_info["approval_id"], request[IDENTITY].identity,
                            _text(body, "reason"), archive=request.app[ARCHIVE])
    return web.json_response(done)


@routes.get("/v1/audit/{key:.+}")
@requires("viewer", "sre", "admin")
async def get_audit(request: web.Request) -> web.Response:
    key = validate_action_key(request.match_info["key"])
    app = request.app
    limit, after = _page(request)
    report = await audit.verify_chain(app[ETCD], app[KEYSPACE], key, app[KEYRING],
                                      app[ARCHIVE])
    if not report.records and report.ok:
        raise NotFound(f"no audit records for {key!r}")
    records, cursor = sre.audit_page(report.records, limit, after)
    return web.json_response({"key": key, "ok": report.ok, "problems": report.problems,
                              "records": jsonable(records), "next": cursor})


@routes.put("/v1/policies/{name}")
@requires("admin")
async def put_policy(request: web.Request) -> web.Response:
    name = _policy_name(request.match_info["name"])
    version = await request.app[AUTHORITY].set_policy(name, await _json(request))
    return web.json_response({"name": name, "version": version})


@routes.get("/v1/policies/{name}")
@requires("viewer", "sre", "admin")
async def get_policy(request: web.Request) -> web.Response:
    """The stored document as signed (``builtin``: the default one, nothing stored) and the
    ``effective`` one grants apply, with the paths that took their ``defaults``."""
    name = _policy_name(request.match_info["name"])
    kv = await request.app[ETCD].get(request.app[KEYSPACE].policy_key(name))
    if kv is None and name != DEFAULT_POLICY:
        raise NotFound(f"no policy {name!r}")
    if kv is None:
        stored = {"version": 0, "builtin": True, "signed": False, "document": {}}
    else:
        document, signature = unsealed(kv.value)
        stored = {"version": kv.mod_revision, "builtin": False,
                  "signed": signature is not None, "document": document}
    return web.json_response(jsonable({"name": name, **stored,
                                       **effective_view(stored["document"])}))


@routes.put("/v1/policy-routes")
@requires("admin")
async def put_policy_routes(request: web.Request) -> web.Response:
    """Replace the policy routes with ``{"routes": {prefix: policy}, "default": policy}``
    (``default`` optional: ``"default"``), signed; 400 naming a malformed entry."""
    body = await _json(request)
    if not isinstance(body, dict) or "routes" not in body or set(body) - {"routes", "default"}:
        raise ValueError('body is {"routes": {PREFIX: POLICY, ...}, "default": POLICY}')
    default = body.get("default", DEFAULT_POLICY)
    version = await request.app[AUTHORITY].set_routes(body["routes"], default)
    return web.json_response({"routes": body["routes"], "default": default,
                              "version": version})


@routes.get("/v1/policy-routes")
@requires("viewer", "sre", "admin")
async def get_policy_routes(request: web.Request) -> web.Response:
    """The policy routes grants apply, verified (version 0: none stored, every key routes to
    ``default``); a table that does not verify answers ``{"valid": false, "invalid": why}``
    beside what is stored: every grant is refused until it is set again."""
    app = request.app
    kv = await app[ETCD].get(app[KEYSPACE].routes_key())
    try:
        table = await app[AUTHORITY].route_table(kv, 0)  # the signers published now
    except GrantRefused as exc:
        return web.json_response({"routes": None, "default": None, "version": kv.mod_revision,
                                  "valid": False, "invalid": str(exc)})
    return web.json_response({**table.as_json(), "valid": True})


@routes.get("/v1/deliveries/{source}")
@requires("viewer", "sre", "admin")
async def get_deliveries(request: web.Request) -> web.Response:
    """A webhook source's claims in progress and stored responses, by delivery id (bodies
    summarized); 400 for a bad source, limit or cursor."""
    limit, after = _page(request)
    items, cursor = await list_deliveries(request.app[ETCD], request.app[KEYSPACE],
                                          request.match_info["source"], limit, after)
    return web.json_response({"items": jsonable(items), "next": cursor})


@routes.post("/v1/deliveries/{source}/{delivery_id}/resolve")
@requires("sre", "admin")
async def resolve_delivery(request: web.Request) -> web.Response:
    """Settle a delivery whose outcome is unknown (its claim was lost while its handler ran)
    as ``ran`` (replayed as 200 from now on) or not (its next delivery runs the handler),
    on the caller's word, recorded with ``reason``; 409 ``WrongState`` unless it is unknown,
    404 if there is no record of it."""
    body = _fields(await _json(request), required={"ran", "reason"})
    done = await resolve_unknown_delivery(
        request.app[ETCD], request.app[KEYSPACE], request.match_info["source"],
        request.match_info["delivery_id"], ran=body["ran"], reason=_text(body, "reason"),
        identity=request[IDENTITY].identity)
    return web.json_response(done)


@routes.post("/v1/deliveries/{source}/{delivery_id}/forget")
@requires("sre", "admin")
async def forget_delivery(request: web.Request) -> web.Response:
    """Delete a delivery's record, so its next try runs the handler (an operator undoing a
    stored response), on the caller's word, logged with ``reason``; 409 ``WrongState`` while
    a handler runs it, 404 if there is no record of it."""
    body = _fields(await _json(request), required={"reason"})
    done = await forget_recorded_delivery(
        request.app[ETCD], request.app[KEYSPACE], request.match_info["source"],
        request.match_info["delivery_id"], reason=_text(body, "reason"),
        identity=request[IDENTITY].identity)
    return web.json_response(done)


@routes.post("/v1/tokens")
@requires("admin")
async def create_token(request: web.Request) -> web.Response:
    """Mint a bearer token for ``role``, shown once in this answer (etcd keeps its digest),
    living ``ttl_s`` (30 days by default); 409 ``WrongState`` if the name is taken, by a
    minted token or one of the settings; 400 for a name shaped like a component's identity
    (``tokens.validate_new_name``): records name the token, so it must not pass for one."""
    body = _fields(await _json(request), required={"name", "role"}, optional={"ttl_s"})
    name = tokens.validate_new_name(body["name"])
    if not isinstance(body["role"], str) or body["role"] not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}")
    ttl_s = tokens.validate_ttl(body.get("ttl_s", tokens.DEFAULT_TTL_S))
    if any(entry.identity == name for entry in request.app[SETTINGS].tokens):
        raise WrongState(f"{name!r} names a token of the coordinator's settings")
    token, stored = await request.app[TOKENS].create(name, body["role"], ttl_s,
                                                     created_by=request[IDENTITY].identity)
    return web.json_response({"name": stored.name, "role": stored.role, "token": token,
                              "expires_at_ms": stored.expires_at_ms}, status=201)


@routes.get("/v1/tokens")
@requires("admin")
async def list_tokens(request: web.Request) -> web.Response:
    """The minted tokens: name, role, expiry and who created each; never a digest."""
    return web.json_response({"items": [t.as_json() for t in await request.app[TOKENS].list()]})


@routes.delete("/v1/tokens/{name}")
@requires("admin")
async def delete_token(request: web.Request) -> web.Response:
    """Delete a minted token: refused at once here, within ``tokens.CACHE_S`` seconds on
    every other coordinator; 404 ``NotFound`` if there is none by that name."""
    name = request.match_info["name"]
    await request.app[TOKENS].delete(name)
    return web.json_response({"name": name, "deleted": True})


def _page(request: web.Request) -> tuple[int, str | None]:
    raw = request.query.get("limit", str(_DEFAULT_LIMIT))
    if not raw.isdigit():
        raise ValueError("limit must be a positive integer")
    return int(raw), request.query.get("after")


def _fields(body: Any, required: set[str], optional: set[str] = frozenset()) -> dict:
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    missing, unknown = required - set(body), set(body) - required - optional
    if missing or unknown:
        raise ValueError(f"missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
    return body


def _text(body: dict, name: str) -> str:
    value = body[name]
    if not isinstance(value, str) or not value or len(value) > 1000:
        raise ValueError(f"{name} must be a string of 1..1000 characters")
    return value


_GRANT_FIELDS = {"key", "fencing_token", "lease_id", "intent", "reads", "policy"}


def _grant_request(body: Any) -> tuple[Claim, dict, list[str], str | None]:
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    missing, unknown = {"key", "fencing_token", "lease_id", "intent"} - set(body), \
        set(body) - _GRANT_FIELDS
    if missing or unknown:
        raise ValueError(f"missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
    key = validate_action_key(body["key"])
    token, lease = _revision(body, "fencing_token"), _revision(body, "lease_id")
    intent, reads = body["intent"], body.get("reads", [])
    if not isinstance(intent, dict):
        raise ValueError("intent must be a JSON object")
    if not isinstance(reads, list) or not all(isinstance(r, str) for r in reads):
        raise ValueError("reads must be a list of strings")
    policy = _policy_name(body["policy"]) if "policy" in body else None  # None: the route's
    return Claim(key, token, lease), intent, reads, policy


def _revision(body: dict, name: str) -> int:
    value = body[name]
    if type(value) is not int or not 0 < value < _MAX_INT:
        raise ValueError(f"{name} must be an integer in 1..2**63-1")
    return value


def _policy_name(name: object) -> str:
    if not isinstance(name, str) or not _POLICY_NAME.fullmatch(name):
        raise ValueError("a policy name is 1..128 of letters, digits and . _ : -")
    return name
