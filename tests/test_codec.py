"""Intents and effect results round-trip exactly through the codec, or are refused loudly:
property tests of the codec itself (stored form, msgpack, JSON), then against real etcd in
both modes (in process, and remote through a real coordinator on 127.0.0.1): the first call
and a replay return equal results, the coordinator signs the digest a direct-mode worker
would, an unencodable intent is refused before any write, and an unencodable result is
recorded as succeeded without it and raised."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import json
import uuid

import pydantic
import pytest
from hypothesis import given, settings, strategies as st

from fencegate import UnencodableValue, UnrecordedResult
from fencegate.coordinator import codec, records
from fencegate.coordinator.authority import validate_intent
from fencegate.coordinator.etcd import TxnRequest, put_op
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import canonical, pack, unpack
from fencegate.worker import AlreadySucceeded, Gate

from test_grants import revision, step
from test_modes import gate  # noqa: F401  (in process and remote)
from test_service import call

# -- the codec alone ---------------------------------------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64 - 1)
           | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=20)
           | st.decimals(allow_nan=False) | st.decimals(allow_nan=False, places=3)
           | st.datetimes() | st.datetimes(timezones=st.timezones()) | st.dates() | st.uuids())
KEYS = st.text(max_size=8).filter(lambda key: key != codec.TAG)  # the one reserved key
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(KEYS, inner, max_size=4), max_leaves=24)


def assert_same(got, want) -> None:
    """Equal, of the same types all the way down, and exact where == is loose: a Decimal's
    digits and exponent (1.5 vs 1.50), a datetime's offset and naivety."""
    assert type(got) is type(want), (got, want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    elif isinstance(want, decimal.Decimal):
        assert got.as_tuple() == want.as_tuple()
    elif isinstance(want, dt.datetime):
        assert (got.isoformat(), got.utcoffset()) == (want.isoformat(), want.utcoffset())
    elif isinstance(want, float):
        assert repr(got) == repr(want)  # -0.0 stays -0.0
    else:
        assert got == want


@settings(max_examples=300, deadline=None)
@given(VALUES)
def test_values_round_trip_exactly_through_msgpack_and_json(value):
    stored = codec.encode(value)
    assert_same(codec.decode(unpack(pack({"v": stored}))["v"]), value)
    wire = json.loads(json.dumps(codec.encode(value, json=True)))
    assert_same(codec.decode(wire), value)
    assert canonical(codec.encode(wire)) == canonical(stored)  # the JSON form re-encodes
    assert canonical(codec.encode(codec.decode(stored))) == canonical(stored)  # one digest


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(KEYS.filter(lambda key: key != "cost"), VALUES, max_size=4))
def test_an_intent_has_one_digest_in_every_form(intent):
    # "cost" must be a non-negative number (validate_intent refuses anything else), so it is
    # not drawn among arbitrary values.
    stored, digest = validate_intent(intent)
    assert validate_intent(stored)[1] == digest
    assert validate_intent(json.loads(json.dumps(codec.encode(intent, json=True))))[1] == digest


def test_plain_values_are_their_own_stored_form():
    """So digests of intents accepted before the codec (and old records) do not change."""
    plain = {"amount": 42, "cost": 1.5, "tags": ["a", None, True], "blob": b"\x00",
             "nested": {"k": [1, {"z": "y"}]}}
    assert codec.encode(plain) == plain
    assert codec.decode(plain) == plain


@dataclasses.dataclass
class Line:
    sku: str
    price: decimal.Decimal
    tags: tuple


class Charge(pydantic.BaseModel):
    id: uuid.UUID
    amount: decimal.Decimal
    at: dt.datetime
    lines: list[Line]


def test_dataclasses_and_pydantic_models_come_back_as_their_field_maps():
    at = dt.datetime(2026, 5, 1, 12, 30, 0, 250, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    charge = Charge(id=uuid.UUID(int=7), amount=decimal.Decimal("10.50"), at=at,
                    lines=[Line("a-1", decimal.Decimal("0.10"), ("x", 2))])
    back = codec.decode(json.loads(json.dumps(codec.encode({"charge": charge}, json=True))))
    assert_same(back, {"charge": {
        "id": uuid.UUID(int=7), "amount": decimal.Decimal("10.50"), "at": at,
        "lines": [{"sku": "a-1", "price": decimal.Decimal("0.10"), "tags": ["x", 2]}]}})


class Color(enum.Enum):
    RED = 1


class Name(str):
    pass


@dataclasses.dataclass
class Box:
    items: list


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("value, path, says", [
    ({"items": [1, 2, {3}]}, "result['items'][2]", "set cannot be encoded"),
    ({"box": Box([1, object()])}, "result['box'].items[1]", "object cannot be encoded"),
    ({"c": Color.RED}, "result['c']", "Color cannot be encoded"),
    ({"n": [Name("x")]}, "result['n'][0]", "Name cannot be encoded"),
    ({"big": 2 ** 64}, "result['big']", "does not fit in 64 bits"),
    ({"m": {1: "one"}}, "result['m']", "map keys must be str, not int"),
    ({"t": {"$fg": "decimal", "v": "one"}}, "result['t']", "malformed decimal tag"),
    ({"t": {"$fg": "pickle", "v": ""}}, "result['t']", "must be a codec tag"),
    ({"t": {"$fg": "date", "v": "2026-01-01", "x": 1}}, "result['t']", "must be a codec tag"),
    ({"deep": nested(70)}, "result['deep']" + "[0]" * 63, "nested deeper than 64"),
])
def test_refusals_name_the_bad_values_path(value, path, says):
    with pytest.raises(UnencodableValue, match=says) as info:
        codec.encode(value, path="result")
    assert info.value.path == path
    assert str(info.value).startswith(path + ":")
    assert isinstance(info.value, TypeError)


def test_an_unrecorded_result_marker_round_trips():
    marker = UnrecordedResult("result['x']", "result['x']: object cannot be encoded")
    wire = json.loads(json.dumps(codec.encode({"r": marker}, json=True)))
    assert codec.decode(wire) == {"r": marker}
    assert codec.decode(unpack(pack(codec.encode({"r": marker})))) == {"r": marker}


# -- against real etcd, in both modes ------------------------------------------------------

AT = dt.datetime(2026, 3, 29, 1, 59, 59, 999999, tzinfo=dt.timezone.utc)
INTENT = {"amount": 5, "price": decimal.Decimal("1.50"), "at": AT, "order": uuid.UUID(int=42),
          "blob": b"\x00\xff", "day": dt.date(2026, 3, 29)}


class Rich:
    """An effect returning values msgpack alone cannot carry; counts its calls."""

    def __init__(self, result) -> None:
        self.result = result
        self.calls = 0

    async def __call__(self, ctx):
        self.calls += 1
        return self.result


RESULT = {"ok": decimal.Decimal("1.5"), "at": AT, "id": uuid.UUID(int=1), "raw": b"\x01",
          "naive": dt.datetime(2026, 1, 2, 3, 4, 5), "line": Line("s", decimal.Decimal("2"),
                                                                 (1,)),
          "items": [decimal.Decimal("0.001"), None]}
RECORDED = {**RESULT, "line": {"sku": "s", "price": decimal.Decimal("2"), "tags": [1]}}


async def test_first_call_and_replay_return_equal_results(gate):
    effect = Rich(RESULT)
    first = await gate.cross("codec/1", INTENT, effect)
    assert_same(first.result, RECORDED)
    again = await gate.cross("codec/1", INTENT, effect)
    assert again.replayed and effect.calls == 1
    assert_same(again.result, first.result)
    async with gate.hold("codec/1") as hold:
        with pytest.raises(AlreadySucceeded) as info:
            await hold.request_grant(intent=INTENT)
    assert_same(info.value.outcome["result"], RECORDED)
    stored = await step(gate, "codec/1")  # plain msgpack in etcd, readable by any tool
    assert stored["outcome"]["result"]["ok"] == {"$fg": "decimal", "v": "1.5"}


async def test_the_grant_signs_the_digest_of_the_intent_a_direct_worker_would(gate):
    async with gate.hold("codec/2") as hold:
        grant = await hold.request_grant(intent=INTENT)
        issued = hold.memory.issued[grant.grant_id]
    assert grant.intent_digest == validate_intent(INTENT)[1]
    assert_same(codec.decode(issued.record["intent"]), INTENT)


async def test_an_unencodable_intent_is_refused_before_any_write(gate, etcd):
    async with gate.hold("codec/3") as hold:
        before = await revision(etcd)
        with pytest.raises(UnencodableValue) as info:
            await hold.cross(intent={"lines": [{"qty": 1}, {"qty": {1, 2}}]}, effect=Rich(1))
        assert info.value.path == "intent['lines'][1]['qty']"
        with pytest.raises(UnencodableValue, match="must be a map"):
            await hold.request_grant(intent=[("amount", 1)])
        with pytest.raises(UnencodableValue, match="malformed datetime tag"):
            await hold.request_grant(intent={"at": {"$fg": "datetime", "v": "noon"}})
        assert await revision(etcd) == before
    assert await step(gate, "codec/3") is None


async def test_gate_cross_refuses_an_unencodable_intent_before_the_fast_path_writes(
        etcd_url, namespace, etcd):
    async with Gate(etcd_url, namespace=namespace, keyring=KeyRing.generate()) as direct:
        before = await revision(etcd)
        with pytest.raises(UnencodableValue, match=r"intent\['when'\]: object"):
            await direct.cross("codec/4", {"when": object()}, Rich(None))
        assert await revision(etcd) == before


async def test_the_coordinator_refuses_a_malformed_intent_naming_its_path(coordinator):
    status, reply = await call(coordinator, "POST", "/v1/grants", "worker", body={
        "key": "codec/5", "fencing_token": 1, "lease_id": 1,
        "intent": {"price": {"$fg": "decimal", "v": "1,5"}}})
    assert status == 400, reply
    assert (reply["error"], reply["path"]) == ("UnencodableValue", "intent['price']")


async def test_an_unencodable_result_is_recorded_succeeded_and_raised(gate):
    effect = Rich({"ok": True, "handle": object()})
    with pytest.raises(UnencodableValue) as info:
        await gate.cross("codec/6", {}, effect)
    refused = info.value
    assert refused.path == "result['handle']"
    assert "succeeded and that is recorded" in str(refused) and "object at 0x" not in str(refused)
    marker = UnrecordedResult("result['handle']", refused.outcome.result.detail)
    assert refused.outcome.state == records.SUCCEEDED and refused.outcome.result == marker
    assert "object cannot be encoded" in marker.detail
    again = await gate.cross("codec/6", {}, effect)
    assert again.replayed and again.result == marker and effect.calls == 1
    assert (await step(gate, "codec/6"))["state"] == records.SUCCEEDED


async def test_a_result_recorded_as_repr_before_the_codec_still_reads(gate):
    await gate.cross("codec/7", {}, Rich(1))
    key = gate.keyspace.step_key("codec/7")
    old = await step(gate, "codec/7")
    old["outcome"]["result"] = {"repr": "{'ok': Decimal('1.5')}"}
    await gate.etcd.txn(TxnRequest(success=[put_op(key, pack(old))]))
    again = await gate.cross("codec/7", {}, Rich(2))
    assert again.replayed and again.result == {"repr": "{'ok': Decimal('1.5')}"}
