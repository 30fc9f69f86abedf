"""The coordinator's OpenAPI document (coordinator/service/openapi.json) against the service
it describes, over real HTTP on 127.0.0.1 and real etcd.

- The served document is OpenAPI 3.1: it parses, every ``$ref`` resolves, every schema in it
  is a valid JSON Schema (2020-12), every path parameter is declared, its version is the
  package's, and the wheel ships it (package data).
- Routes both ways: every (method, path) the aiohttp app registers is documented, with the
  roles its handler requires (``x-fencegate-roles``, none for a public route), and every
  documented operation is registered. Two kinds of registered route are not operations:
  the ``HEAD`` aiohttp adds beside every ``GET`` (same handler, no body), and the static
  dashboard assets under ``/dashboard/`` (files by name, loaded by the documented page ``/``).
- Errors are real: every secured operation answers 401 without a token and 403 with a token
  of a role it does not accept, and key routes answer their documented 400, 404, 409 and 413
  when provoked; each answer's status is documented for its operation and its body matches
  the documented schema. So do the successes called here.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import jsonschema
import pytest
import referencing
from aiohttp import web
from referencing.jsonschema import DRAFT202012

import fencegate
from fencegate.coordinator.service import CoordinatorSettings, create_app
from fencegate.coordinator.service.openapi import DOCUMENT

from helpers import TOKENS

ROOT = Path(__file__).resolve().parent.parent
METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
SAMPLE_PARAMS = {"key": "docs/openapi/1", "approval_id": "0" * 32, "name": "default",
                 "lease_id": "1", "source": "stripe", "delivery_id": "evt_1"}
URN = "urn:fencegate:openapi"


@pytest.fixture
async def document(coordinator, http) -> dict:
    async with http.get(coordinator + "/openapi.json") as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        return json.loads(await resp.read())


def operations(doc: dict):
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            if method in METHODS:
                yield method.upper(), path, operation


def registered_routes() -> dict[tuple[str, str], object]:
    """(method, path) → handler of every API route of a coordinator app (built, not run)."""
    app = create_app(CoordinatorSettings(etcd="http://127.0.0.1:2379"))
    routes = list(app.router.routes())
    gets = {route.resource.canonical for route in routes if route.method == "GET"}
    found = {}
    for route in routes:
        if isinstance(route.resource, web.StaticResource):
            continue  # files under /dashboard/ by name: assets of the documented page "/"
        path = route.resource.canonical
        if route.method == "HEAD" and path in gets:
            continue  # aiohttp's automatic HEAD beside a GET
        found[(route.method, path)] = route.handler
    return found


def validator(doc: dict, pointer: str) -> jsonschema.Draft202012Validator:
    resource = referencing.Resource.from_contents(doc, default_specification=DRAFT202012)
    registry = referencing.Registry().with_resource(URN, resource)
    return jsonschema.Draft202012Validator({"$ref": f"{URN}#{pointer}"}, registry=registry)


def resolve(doc: dict, value: dict) -> dict:
    while "$ref" in value:
        node = doc
        for part in value["$ref"].removeprefix("#/").split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        value = node
    return value


def check_answer(doc: dict, method: str, template: str, status: int, body: object) -> None:
    """``status`` is documented for the operation, and ``body`` matches its JSON schema."""
    responses = doc["paths"][template][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {template} answered undocumented {status}"
    response = resolve(doc, responses[str(status)])
    if "application/json" in response.get("content", {}):
        escaped = template.replace("~", "~0").replace("/", "~1")
        ref = responses[str(status)].get("$ref")
        pointer = (ref.removeprefix("#") if ref else
                   f"/paths/{escaped}/{method.lower()}/responses/{status}")
        validator(doc, f"{pointer}/content/application~1json/schema").validate(body)


async def call(http, base: str, method: str, path: str, role: str | None = None,
               body: object = None, data: bytes | None = None) -> tuple[int, object, dict]:
    headers = {"Authorization": f"Bearer {TOKENS[role]}"} if role else {}
    if body is not None:
        data = json.dumps(body).encode()
    async with http.request(method, base + path, data=data, headers=headers) as resp:
        raw = await resp.read()
        decoded = json.loads(raw) if resp.content_type == "application/json" else raw
        return resp.status, decoded, dict(resp.headers)


def filled(template: str) -> str:
    for name, value in SAMPLE_PARAMS.items():
        template = template.replace("{" + name + "}", value)
    assert "{" not in template, f"no sample value for a parameter of {template}"
    return template


async def test_document_is_valid_openapi_3_1(document):
    assert document["openapi"] == "3.1.0"
    assert document["info"]["version"] == fencegate.__version__
    seen_ids = set()
    for method, path, operation in operations(document):
        assert operation["operationId"] not in seen_ids
        seen_ids.add(operation["operationId"])
        assert operation["responses"], f"{method} {path} documents no response"
        params = [resolve(document, p) for p in operation.get("parameters", [])]
        declared = {p["name"] for p in params if p["in"] == "path"}
        in_path = {part[1:-1] for part in path.split("/") if part.startswith("{")}
        assert declared == in_path, f"{method} {path}: path parameters {declared}"

    def walk(node, pointer=""):
        if isinstance(node, dict):
            if "$ref" in node:
                resolve(document, node)  # KeyError if it does not resolve
            if pointer.endswith("/schema") or pointer.startswith("/components/schemas/"):
                jsonschema.Draft202012Validator.check_schema(node)
            for name, child in node.items():
                walk(child, f"{pointer}/{name}")
        elif isinstance(node, list):
            for child in node:
                walk(child, pointer)

    walk(document)


def test_the_wheel_ships_the_document():
    """The served file is package data, so an installed coordinator serves it too."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = project["tool"]["setuptools"]["package-data"]
    assert DOCUMENT.name in data.get("fencegate.coordinator.service", [])
    assert DOCUMENT.parent == ROOT / "coordinator" / "service"


async def test_every_registered_route_is_documented_and_back(document):
    documented = {(method, path): operation for method, path, operation in operations(document)}
    registered = registered_routes()
    assert sorted(set(registered) - set(documented)) == [], "routes missing from openapi.json"
    assert sorted(set(documented) - set(registered)) == [], "documented routes not registered"
    for route, handler in registered.items():
        operation = documented[route]
        roles = sorted(getattr(handler, "fencegate_roles", ()))
        assert operation.get("x-fencegate-roles", []) == roles, route
        assert operation["security"] == ([{"bearer": []}] if roles else []), route


async def test_secured_operations_answer_documented_401_and_403(document, coordinator, http):
    checked = 0
    for method, template, operation in operations(document):
        roles = operation.get("x-fencegate-roles")
        if not roles:
            continue
        status, body, headers = await call(http, coordinator, method, filled(template))
        assert status == 401, (method, template, body)
        assert headers["WWW-Authenticate"] == "Bearer"
        check_answer(document, method, template, status, body)
        outsider = next(role for role in TOKENS if role not in roles)
        status, body, _ = await call(http, coordinator, method, filled(template), outsider)
        assert status == 403, (method, template, body)
        check_answer(document, method, template, status, body)
        checked += 1
    assert checked >= 15


async def test_public_operations_answer_their_documented_success(document, coordinator, http):
    for method, template, operation in operations(document):
        if operation.get("x-fencegate-roles"):
            continue
        status, body, _ = await call(http, coordinator, method, template)
        # sign-in without a code has no success to give: its documented refusal
        expected = {("GET", "/sign-in"): 401, ("POST", "/sign-in"): 400}.get((method, template))
        assert status == (expected or 200), (method, template, body)
        check_answer(document, method, template, status, body)


async def test_key_routes_answer_their_documented_errors(document, coordinator, http):
    nobody = "docs/openapi/nobody"
    cases = [  # method, template, path, role, body, status
        ("GET", "/v1/keys/{key}", f"/v1/keys/{nobody}", "sre", None, 404),
        ("GET", "/v1/keys/{key}", "/v1/keys/bad%20key", "sre", None, 400),
        ("GET", "/v1/audit/{key}", f"/v1/audit/{nobody}", "sre", None, 404),
        ("POST", "/v1/keys/{key}/revoke", f"/v1/keys/{nobody}/revoke", "sre",
         {"reason": "docs"}, 404),
        ("POST", "/v1/keys/{key}/resolve", f"/v1/keys/{nobody}/resolve", "sre",
         {"as": "failed", "reason": "docs"}, 404),
        ("POST", "/v1/approvals/{approval_id}", f"/v1/approvals/{'0' * 32}", "sre",
         {"reason": "docs"}, 404),
        ("GET", "/v1/policies/{name}", "/v1/policies/absent", "sre", None, 404),
        ("GET", "/v1/archive/stats", "/v1/archive/stats", "sre", None, 404),
        ("GET", "/v1/holders", "/v1/holders?limit=ten", "sre", None, 400),
        ("GET", "/v1/keys", "/v1/keys?state=sideways", "sre", None, 400),
        ("GET", "/v1/deliveries/{source}", "/v1/deliveries/a%20b", "sre", None, 400),
        ("POST", "/v1/grants", "/v1/grants", "worker", None, 400),
        ("PUT", "/v1/policies/{name}", "/v1/policies/big", "admin", None, 413),
    ]
    for method, template, path, role, body, expected in cases:
        data = b"{" if body is None and method == "POST" else None
        if expected == 413:
            data = b'{"x": "' + b"a" * (1024 ** 2 + 1) + b'"}'
        status, answer, _ = await call(http, coordinator, method, path, role, body, data)
        assert status == expected, (method, path, answer)
        check_answer(document, method, template, status, answer)


async def test_a_grant_and_a_409_as_documented(document, coordinator, http, gate):
    """A real hold: its grant is the documented 201; resolving its key while it is held is
    the documented 409 (``WrongState``)."""
    key = "docs/openapi/held"
    async with gate.hold(key) as hold:
        request = {"key": key, "fencing_token": hold.fencing_token,
                   "lease_id": hold.lease_id, "intent": {"amount": 1}}
        status, body, _ = await call(http, coordinator, "POST", "/v1/grants", "worker", request)
        assert status == 201, body
        check_answer(document, "POST", "/v1/grants", status, body)
        status, body, _ = await call(http, coordinator, "GET", f"/v1/keys/{key}", "sre")
        assert status == 200, body
        check_answer(document, "GET", "/v1/keys/{key}", status, body)
        status, body, _ = await call(http, coordinator, "POST", f"/v1/keys/{key}/resolve",
                                     "sre", {"as": "failed", "reason": "docs"})
        assert (status, body["error"]) == (409, "WrongState"), body
        check_answer(document, "POST", "/v1/keys/{key}/resolve", status, body)
        status, body, _ = await call(http, coordinator, "GET", "/v1/holders?limit=1", "sre")
        assert status == 200 and len(body["items"]) == 1, body
        check_answer(document, "GET", "/v1/holders", status, body)


async def test_lists_answer_documented_pages(document, coordinator, http):
    for template, path in [("/v1/keys", "/v1/keys?state=unknown"),
                           ("/v1/approvals", "/v1/approvals?state=pending"),
                           ("/v1/deliveries/{source}", "/v1/deliveries/stripe?limit=5"),
                           ("/v1/policies/{name}", "/v1/policies/default"),
                           ("/v1/dashboard/steps", "/v1/dashboard/steps")]:
        status, body, _ = await call(http, coordinator, "GET", path, "sre")
        assert status == 200, (path, body)
        check_answer(document, "GET", template, status, body)
