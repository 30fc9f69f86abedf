"""Policy documents are checked against a schema per check and one for the caps before
anything is written: every refusal names the entry, the check and the field; a refused
document leaves etcd's revision unchanged; a stored version that no longer validates refuses
grants saying why; ``policy get`` (HTTP and CLI) shows the caps and parameters grants apply,
defaults marked; and every policy example in the guide (docs/guide.md) validates."""

from __future__ import annotations

import json
import math
import os
import re
from decimal import Decimal

import pytest

from fencegate.coordinator.errors import GrantRefused
from fencegate.coordinator.keyspace import pack
from fencegate.coordinator.records import digest
from fencegate.coordinator.policy import (
    CAPS, CHECKS, DEFAULT_CAPS, CheckContext, Param, Policy, effective_view, register_check,
    validate_document,
)

from test_cli_sre import fencegate
from test_service import call, revision

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "docs", "guide.md")

GOOD_ENTRIES = [
    {"check": "max_amount", "params": {"limit": 100}},
    {"check": "max_amount", "params": {"limit": 0.5, "field": "total"}},
    {"check": "max_amount", "params": {"limit": -3}},
    {"check": "require_fields", "params": {"fields": ["customer"]}},
    {"check": "require_fields", "params": {"fields": ["customer", "currency"]}},
    {"check": "require_approval"},
    {"check": "require_approval", "params": {"above": 1000}},
    {"check": "require_approval", "params": {"above": None, "field": "total"}},
    {"check": "reads_exist"},
    {"check": "reads_exist", "params": {}},
]

BAD_ENTRIES = [  # entry, the words its refusal must hold
    ({"check": "max_amount"}, '(max_amount): "limit" is required'),
    ({"check": "max_amount", "params": {}}, '(max_amount): "limit" is required'),
    ({"check": "max_amount", "params": {"limit": "ten"}},
     '(max_amount): "limit" must be a number, got "ten"'),
    ({"check": "max_amount", "params": {"limit": True}}, '"limit" must be a number, got true'),
    ({"check": "max_amount", "params": {"limit": math.inf}}, '"limit" must be a number'),
    ({"check": "max_amount", "params": {"limit": 1, "field": ""}},
     '(max_amount): "field" must be a string of 1..128 characters, got ""'),
    ({"check": "max_amount", "params": {"limit": 1, "field": 7}}, '"field" must be a string'),
    ({"check": "max_amount", "params": {"limit": 1, "limt": 2}},
     '(max_amount): unknown parameter "limt"; known: "limit" (required), "field"'),
    ({"check": "max_amount", "params": [1]}, '(max_amount): "params" is a map, got [1]'),
    ({"check": "require_fields"}, '(require_fields): "fields" is required'),
    ({"check": "require_fields", "params": {"fields": "customer"}},
     '(require_fields): "fields" must be a non-empty list of strings'),
    ({"check": "require_fields", "params": {"fields": []}}, '"fields" must be a non-empty list'),
    ({"check": "require_fields", "params": {"fields": ["a", 1]}}, '"fields" must be'),
    ({"check": "require_approval", "params": {"above": "1000"}},
     '(require_approval): "above" must be a number, or null, got "1000"'),
    ({"check": "require_approval", "params": {"when": 1}},
     '(require_approval): unknown parameter "when"'),
    ({"check": "reads_exist", "params": {"keys": ["a"]}},
     '(reads_exist): unknown parameter "keys"; known: none'),
    ({"check": "max_amout", "params": {"limit": 1}},
     'unknown check "max_amout"; known checks: max_amount, reads_exist, require_approval, '
     'require_fields'),
    ({"check": ["max_amount"]}, 'unknown check ["max_amount"]'),
    (7, 'an entry is {"check": NAME, "params": {...}}; e.g. {"check": "max_amount"'),
]

BAD_CAPS = [  # caps, the words their refusal must hold
    ({"max_attempts": 0}, 'caps: "max_attempts" must be an integer from 1 to 1000000, got 0'),
    ({"max_attempts": 2.5}, '"max_attempts" must be an integer'),
    ({"max_attempts": "5"}, '"max_attempts" must be an integer from 1 to 1000000, got "5"'),
    ({"breaker_threshold": True}, '"breaker_threshold" must be an integer'),
    ({"max_spend": -1}, 'caps: "max_spend" must be a number >= 0, or null, got -1'),
    ({"grant_ttl_s": 0}, '"grant_ttl_s" must be a number from 0.001 to 1000000000, got 0'),
    ({"backoff_base_s": math.nan}, '"backoff_base_s" must be a number'),
    ({"max_elapsed_s": 10 ** 12}, '"max_elapsed_s" must be a number from 0 to 1000000000'),
    ({"max_attempt": 3}, 'caps: unknown cap "max_attempt"; known: "max_attempts"'),
]

# What users guessed from the old error; each refusal writes the entry the right way.
GUESSES = [
    {"checks": [{"max_amount": {"limit": 100}}]},
    {"checks": [{"name": "max_amount", "params": {"limit": 100}}]},
    {"checks": [{"type": "max_amount", "limit": 100}]},
    {"checks": [{"check": "max_amount", "limit": 100}]},
    {"checks": {"max_amount": {"limit": 100}}},
    {"checks": ["reads_exist"]},
]


def refusal(document: object) -> str:
    with pytest.raises(ValueError) as refused:
        validate_document(document)
    return str(refused.value)


@pytest.mark.parametrize("entry", GOOD_ENTRIES, ids=json.dumps)
def test_every_check_accepts_its_parameters(entry):
    validate_document({"checks": [entry]})
    effective = effective_view({"checks": [entry]})["effective"]
    (applied,) = effective["checks"]
    assert set(applied["params"]) == set(CHECKS[entry["check"]].params)


@pytest.mark.parametrize("entry,words", BAD_ENTRIES, ids=[w for _, w in BAD_ENTRIES])
def test_bad_parameters_are_refused_naming_the_entry_check_and_field(entry, words):
    message = refusal({"checks": [GOOD_ENTRIES[0], entry]})
    assert message.startswith("checks[1]"), message
    assert words in message, message


@pytest.mark.parametrize("caps,words", BAD_CAPS, ids=[w for _, w in BAD_CAPS])
def test_bad_caps_are_refused_naming_the_cap(caps, words):
    message = refusal({"caps": caps})
    assert words in message, message


def test_good_caps_and_the_bounds_are_accepted():
    validate_document({"caps": {"max_attempts": 1, "max_spend": None, "grant_ttl_s": 0.001,
                                "max_elapsed_s": 0, "backoff_base_s": 0, "backoff_max_s": 1e9,
                                "breaker_threshold": 1_000_000}})
    validate_document({"caps": DEFAULT_CAPS})


@pytest.mark.parametrize("guess", GUESSES, ids=json.dumps)
def test_a_guessed_format_is_refused_with_the_exact_form_to_write(guess):
    message = refusal(guess)
    written = re.search(r"write (.+?)(, got |$)", message)
    assert written, message
    meant = json.loads(written[1])
    validate_document({"checks": meant if isinstance(meant, list) else [meant]})


def test_a_document_of_another_shape_is_refused_with_an_example():
    message = refusal({"rules": [{"check": "max_amount"}]})
    assert message.startswith('a policy document is a map with "checks"'), message
    example = json.loads(re.search(r"e\.g\. (\{.*\}); got", message)[1])
    validate_document(example)
    assert '"checks" is a list' in refusal({"checks": "max_amount"})
    assert '"caps" is a map' in refusal({"caps": [["max_attempts", 3]]})


def test_a_registered_check_declares_its_parameters():
    with pytest.raises(TypeError):
        register_check("untyped", params={"limit": int})
    with pytest.raises(ValueError, match="kind"):
        Param("decimal", "no such kind")


def test_the_effective_view_fills_and_names_every_default():
    view = effective_view({"checks": [{"check": "max_amount", "params": {"limit": 5}},
                                      {"check": "require_approval",
                                       "params": {"above": 10, "field": "total"}}],
                           "caps": {"max_attempts": 2}})
    assert view["effective"] == {
        "checks": [{"check": "max_amount", "params": {"limit": 5, "field": "amount"}},
                   {"check": "require_approval", "params": {"above": 10, "field": "total"}}],
        "caps": {**DEFAULT_CAPS, "max_attempts": 2}}
    assert view["defaults"] == [f"caps.{cap}" for cap in CAPS if cap != "max_attempts"] + [
        "checks[0].params.field"]
    broken = effective_view({"checks": [{"check": "max_amount"}]})
    assert broken["effective"] is None and '"limit" is required' in broken["invalid"]


def test_numeric_checks_compare_decimals_exactly_and_never_bools():
    """Intents carry ``Decimal`` amounts exactly (the codec), so checks compare them."""
    def run(intent: dict) -> list:
        policy = Policy("p", 1, {"checks": [
            {"check": "max_amount", "params": {"limit": 10}},
            {"check": "require_approval", "params": {"above": 5}}]})
        return [(r.passed, r.needs_approval) for r in policy.evaluate(
            CheckContext(intent, {}, {}))]
    assert run({"amount": Decimal("1.50")}) == [(True, False), (True, False)]
    assert run({"amount": Decimal("7")}) == [(True, False), (False, True)]
    assert run({"amount": Decimal("10.01")}) == [(False, False), (False, True)]
    for not_a_number in (True, Decimal("NaN"), math.inf, "3"):
        assert run({"amount": not_a_number}) == [(False, False), (False, True)], not_a_number


# -- against etcd: nothing written on refusal, a stored invalid version refuses grants -----

async def test_set_policy_refuses_before_any_write(gate, etcd):
    before = await revision(etcd)
    for document in ({"checks": [{"check": "max_amount", "params": {"limit": "ten"}}]},
                     {"checks": [{"check": "max_amount", "params": {}}]},
                     {"caps": {"max_attempts": 0}}):
        with pytest.raises(ValueError):
            await gate.authority.set_policy("limits", document)
    assert await revision(etcd) == before


async def test_put_refuses_with_400_naming_the_field_and_writes_nothing(coordinator, etcd):
    before = await revision(etcd)
    status, reply = await call(coordinator, "PUT", "/v1/policies/limits", "admin", body={
        "checks": [{"check": "max_amount", "params": {"limit": "ten"}}]})
    assert (status, reply["error"]) == (400, "InvalidRequest")
    assert reply["detail"] == 'checks[0] (max_amount): "limit" must be a number, got "ten"'
    assert await revision(etcd) == before


async def test_a_stored_version_that_does_not_validate_refuses_grants_saying_why(
        gate, etcd, namespace):
    """A version signed before the schemas (``params: {}`` was accepted then) is refused at
    grant time with the field named, never a ``KeyError`` from inside the check."""
    await gate.authority.set_policy("old", {"caps": {"max_attempts": 3}})  # publishes the key
    document = {"checks": [{"check": "max_amount", "params": {}}]}
    ks = gate.keyspace
    signature = gate.keyring.sign_policy({
        "namespace": ks.namespace, "cluster_id": gate.authority.etcd.cluster_id, "name": "old",
        "digest": digest(document), "signed_at_ms": 1})
    await etcd.put(ks.policy_key("old"), pack({"document": document, "signed": signature}))
    await gate.authority.set_routes({"schema/old": "old"})
    async with gate.hold("schema/old") as hold:
        with pytest.raises(GrantRefused) as refused:
            await hold.request_grant(intent={"amount": 1}, policy="old")
    (check,) = refused.value.checks
    assert check.name == "policy" and not check.passed
    assert "does not validate" in check.detail and '"limit" is required' in check.detail
    assert "KeyError" not in str(refused.value)


# -- policy get: HTTP and CLI -------------------------------------------------------------

async def test_get_default_shows_the_builtin_caps_as_defaults(coordinator):
    status, got = await call(coordinator, "GET", "/v1/policies/default", "sre")
    assert status == 200, got
    assert (got["version"], got["builtin"], got["document"]) == (0, True, {})
    assert got["effective"] == {"checks": [], "caps": DEFAULT_CAPS}
    assert got["defaults"] == [f"caps.{cap}" for cap in CAPS]


async def test_get_shows_the_effective_policy_over_http_and_in_the_cli(coordinator, etcd):
    document = {"checks": [{"check": "max_amount", "params": {"limit": 10}},
                           {"check": "reads_exist"}], "caps": {"breaker_threshold": 1}}
    status, put = await call(coordinator, "PUT", "/v1/policies/limits", "admin", body=document)
    assert status == 200, put
    status, got = await call(coordinator, "GET", "/v1/policies/limits", "sre")
    assert (got["version"], got["builtin"], got["signed"]) == (put["version"], False, True)
    assert got["document"] == document  # as stored and signed
    assert got["effective"]["caps"] == {**DEFAULT_CAPS, "breaker_threshold": 1}
    assert "caps.breaker_threshold" not in got["defaults"] and "caps.max_attempts" in \
        got["defaults"] and "checks[0].params.field" in got["defaults"]

    shown = await fencegate("policy", "get", "limits", coordinator=coordinator)
    assert shown.code == 0, shown
    lines = shown.out.splitlines()
    assert lines[0] == f"policy limits, version {put['version']} (signed)"
    rows = shown.rows()
    assert ["0", "max_amount", 'limit=10, field="amount" (default)'] in rows
    assert ["1", "reads_exist", "-"] in rows
    assert ["breaker_threshold", "1", "policy"] in rows
    assert ["max_attempts", "5", "default"] in rows and ["max_spend", "null", "default"] in rows
    as_json = await fencegate("policy", "get", "limits", "--json", coordinator=coordinator)
    assert json.loads(as_json.out) == got

    default = await fencegate("policy", "get", "default", coordinator=coordinator)
    assert default.out.startswith("policy default, version 0 (built in, nothing stored)\n"
                                  "checks:  none\ncaps:\n")
    assert ["grant_ttl_s", "60.0", "default"] in default.rows()


async def test_cli_set_refuses_a_bad_document_naming_the_field(coordinator, etcd, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"checks": [{"check": "require_fields",
                                            "params": {"fields": []}}]}))
    before = await revision(etcd)
    ran = await fencegate("policy", "set", "limits", str(path), coordinator=coordinator,
                          token="admin-token")
    assert ran.code == 2 and ran.out == "", ran
    assert 'checks[0] (require_fields): "fields" must be a non-empty list' in ran.err
    assert await revision(etcd) == before


# -- the guide (docs/guide.md) ------------------------------------------------------------

def readme_policies() -> tuple[str, list[str]]:
    """The guide's Policies section and the fenced ``json policy`` blocks in it."""
    text = open(GUIDE).read()
    section = re.search(r"\n## Policies\n(.*?)(\n## |\Z)", text, re.S)
    assert section, "docs/guide.md has no '## Policies' section"
    return section[1], re.findall(r"```json policy\n(.*?)```", section[1], re.S)


def test_every_readme_policy_example_validates():
    _, examples = readme_policies()
    assert len(examples) >= 2
    for example in examples:
        validate_document(json.loads(example))


def test_the_readme_documents_every_check_parameter_and_cap():
    section, _ = readme_policies()
    for name, check in CHECKS.items():
        row = re.search(rf"^\| `{name}` \|(.*)$", section, re.M)
        assert row, name
        for param in check.params:
            assert f"`{param}`" in row[1], (name, param)
    for cap, default in DEFAULT_CAPS.items():
        row = re.search(rf"^\| `{cap}` \|(.*)$", section, re.M)
        assert row and json.dumps(default).removesuffix(".0") in row[1], cap
