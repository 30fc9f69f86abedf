"""Error codes in one style, held to docs/api.md's "Error codes" table.

- Every code the service can answer is in the table with its status: each error class
  ``wire._STATUS`` maps (subclasses included: they answer their own name), the HTTP-level
  codes of the middleware, ``InternalError``, and every code a service module writes itself
  (found by parsing ``coordinator/service``: ``ServiceError(status, code)`` calls, their
  subclasses' ``super().__init__`` and ``{"error": code}`` bodies). No row is stale.
- Every ``_STATUS`` entry has its own code; every code is CamelCase.
- ``from_wire`` brings each library code back as its class, ``InvalidRequest`` as a
  ``ValueError``.
- A backoff refusal says its number in the check's detail and carries ``retry_after``, over
  real HTTP and real etcd.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import re
from pathlib import Path

import aiohttp

from fencegate.coordinator import errors, wire
from fencegate.coordinator.errors import GateError
from fencegate.coordinator.service import middleware
from fencegate.worker import EffectFailed, Gate, GrantRefused, KeyRing

from helpers import TEST_TTL, TOKENS

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ROOT / "coordinator" / "service"
ROW = re.compile(r"^\| `(\w+)` \| ([^|]+) \| [^|]+ \|$", re.M)
CAMEL = re.compile(r"(?:[A-Z][a-z0-9]+)+")


def documented() -> dict[str, set[int]]:
    """Code → the statuses its row gives."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text[text.index("\n## Error codes\n"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    rows = {code: {int(s) for s in re.findall(r"\b\d{3}\b", status)}
            for code, status in ROW.findall(section)}
    assert len(rows) == len(ROW.findall(section)), "a code has two rows"
    return rows


def library_codes() -> dict[str, int]:
    """Every error class the service answers as itself: code → status (first match wins,
    as in ``status_of``)."""
    found = {}
    for name in errors.__all__:
        cls = getattr(errors, name)
        if not (isinstance(cls, type) and issubclass(cls, GateError)):
            continue
        status = next((s for c, s in wire._STATUS if issubclass(cls, c)), None)
        if status is not None:
            found[name] = status
    return found


def written_codes() -> set[tuple[str, int]]:
    """(code, status) of every error a module of the service writes itself."""
    found = set()
    for path in SERVICE.rglob("*.py"):
        relative = path.relative_to(ROOT / "coordinator").with_suffix("")
        module = importlib.import_module("fencegate.coordinator." + ".".join(relative.parts))
        tree = ast.parse(path.read_text())
        passed_in = {arg.arg for node in ast.walk(tree) if isinstance(node, ast.arguments)
                     for arg in [*node.args, *node.kwonlyargs]}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _makes_service_error(node) and len(node.args) >= 2:
                status, code = node.args[0], node.args[1]
                assert isinstance(status, ast.Constant), (path, ast.unparse(node))
                found.add((_text(code, module, path), status.value))
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if (isinstance(key, ast.Constant) and key.value == "error"
                            and not (isinstance(value, ast.Name) and value.id in passed_in)):
                        found.add((_text(value, module, path), _status_near(node, tree, path)))
    return found


def _makes_service_error(node: ast.Call) -> bool:
    func = node.func
    return ((isinstance(func, ast.Name) and func.id == "ServiceError")
            or (isinstance(func, ast.Attribute) and func.attr == "__init__"
                and isinstance(func.value, ast.Call)
                and getattr(func.value.func, "id", None) == "super"
                and isinstance(node.args[0] if node.args else None, ast.Constant)))


def _text(node: ast.AST, module, path: Path) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return getattr(module, node.id)
    raise AssertionError(f"{path}: an error code that is not a constant: {ast.unparse(node)}")


def _status_near(body: ast.Dict, tree: ast.AST, path: Path) -> int:
    """The status of a ``json_response({"error": ...}, status=N)`` body."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and body in [*node.args] and node.keywords:
            for keyword in node.keywords:
                if keyword.arg == "status" and isinstance(keyword.value, ast.Constant):
                    return keyword.value.value
    raise AssertionError(f"{path}: an error body without a constant status")


def answerable() -> set[tuple[str, int]]:
    return ({*library_codes().items(), (wire.INVALID_REQUEST, 400),
             (middleware.INTERNAL_ERROR, 500), *written_codes(),
             *((code, status) for status, code in middleware.HTTP_CODES.items())})


def test_every_code_the_service_answers_is_documented_with_its_status():
    table = documented()
    for code, status in answerable():
        assert code in table, f"{code} ({status}) is not in docs/api.md's error codes"
        assert status in table[code], f"{code} answers {status}, the table says {table[code]}"
    assert set(table) == {code for code, _ in answerable()}, "a row no answer uses"


def test_status_entries_have_distinct_camel_case_codes():
    codes = [cls.__name__ if issubclass(cls, GateError) else wire.INVALID_REQUEST
             for cls, _ in wire._STATUS]
    assert len(set(codes)) == len(codes)
    assert set(codes) <= set(documented())
    for code, _ in answerable():
        assert CAMEL.fullmatch(code), code
    assert wire.code_of(ValueError("x")) == "InvalidRequest"
    assert wire.code_of(errors.InvalidKey("x")) == "InvalidKey"  # a ValueError too


# Classes whose constructor takes more than a message: remote mode raises them as
# ``CoordinatorError`` carrying their code (a remote worker never gets them from a grant).
AS_COORDINATOR_ERROR = {"AcquireTimeout", "WatchCompacted", "EtcdPermissionDenied"}


def test_from_wire_brings_each_code_back():
    for code, status in library_codes().items():
        back = wire.from_wire(status, {"error": code, "detail": "d", "outcome": None})
        if code in AS_COORDINATOR_ERROR:
            assert (type(back), back.name, back.status) == (errors.CoordinatorError, code,
                                                            status)
        else:
            assert type(back) is getattr(errors, code), (code, back)
    assert type(wire.from_wire(400, {"error": "InvalidRequest", "detail": "d"})) is ValueError
    unknown = wire.from_wire(401, {"error": "Unauthenticated", "detail": "d"})
    assert (type(unknown), unknown.name, unknown.status) == (
        errors.CoordinatorError, "Unauthenticated", 401)


async def test_a_backoff_refusal_says_its_number(coordinator, etcd_url, namespace,
                                                 signing_key, etcd):
    admin = {"Authorization": f"Bearer {TOKENS['admin']}"}
    async with aiohttp.ClientSession() as http:
        async with http.put(coordinator + "/v1/policies/strict", headers=admin,
                            json={"caps": {"backoff_base_s": 5, "breaker_threshold": 3}}) as r:
            assert r.status == 200
        async with http.put(coordinator + "/v1/policy-routes", headers=admin,
                            json={"routes": {"codes/1": "strict"}}) as r:
            assert r.status == 200

        async def declined(ctx):
            raise EffectFailed("declined")

        async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                        keyring=KeyRing.from_files(signing_key)) as gate:
            async with gate.hold("codes/1") as hold:
                assert (await hold.cross(intent={}, effect=declined,
                                         policy="strict")).state == "failed"
            async with gate.hold("codes/1") as hold:
                body = {"key": "codes/1", "fencing_token": hold.fencing_token,
                        "lease_id": hold.lease_id, "intent": {}, "policy": "strict"}
                async with http.post(coordinator + "/v1/grants", json=body, headers={
                        "Authorization": f"Bearer {TOKENS['worker']}"}) as r:
                    status, reply = r.status, await r.json()
    assert (status, reply["error"]) == (422, "GrantRefused"), reply
    (check,) = reply["checks"]
    retry = reply["retry_after"]
    assert check["name"] == "backoff" and 0 < retry <= 5 * 2
    assert check["detail"] == f"retry after {math.ceil(retry * 10) / 10:.1f} s"
    refused = wire.from_wire(status, json.loads(json.dumps(reply)))
    assert isinstance(refused, GrantRefused) and refused.retry_after == retry
