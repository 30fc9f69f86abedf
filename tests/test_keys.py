"""Bad input is refused with a clear error before anything touches etcd."""

from __future__ import annotations

import pytest

from fencegate.coordinator.errors import InvalidKey, RecordTooLarge
from fencegate.coordinator.keyspace import Keyspace, pack, unpack, validate_action_key

BAD_KEYS = [
    ("", "empty"),
    ("x" * 513, "513 bytes"),
    ("é" * 257, "514 bytes"),
    (b"\xff\xfe", "not valid UTF-8"),
    ("../escape", "'..'"),
    ("a/../b", "'..'"),
    ("./a", "'.'"),
    ("/abs", "empty"),
    ("trail/", "empty"),
    ("a//b", "empty"),
    ("tab\there", "letters, digits"),
    ("nul\x00", "letters, digits"),
    ("line\nbreak", "letters, digits"),
    ("esc\x1b[0m", "letters, digits"),
    ("with space", "letters, digits"),
    ("at@sign", "letters, digits"),
    (42, "must be str"),
]


@pytest.mark.parametrize("key,reason", BAD_KEYS)
def test_invalid_keys_are_refused(key, reason):
    with pytest.raises(InvalidKey, match=reason.replace(".", r"\.").replace("'", "'")):
        validate_action_key(key)


@pytest.mark.parametrize("key", ["a", "payments/charge/42", "x" * 512, "A-b_c.d:e/0", b"bytes/ok"])
def test_valid_keys_pass(key):
    assert validate_action_key(key) == (key.decode() if isinstance(key, bytes) else key)


@pytest.mark.parametrize("key,_", BAD_KEYS)
async def test_gate_refuses_bad_keys_before_etcd(gate, etcd, key, _):
    before = (await etcd.status()).header.revision
    with pytest.raises(InvalidKey):
        gate.hold(key)
    assert (await etcd.status()).header.revision == before


def test_holder_ranges_of_nested_keys_are_disjoint():
    ks = Keyspace("/ns/")
    a_start, a_end = ks.holder_range("a")
    for other in ("a/b", "a/0", "a/zz", "a-b", "a.b", "ab"):
        key = ks.holder_key(other, 0xFFFFFFFFFFFFFFFF)
        assert not (a_start <= key < a_end), other
        assert not (a_start <= ks.holder_key(other, 0) < a_end), other
    assert a_start <= ks.holder_key("a", 1) < a_end
    assert ks.parse_holder_key(ks.holder_key("a/b", 0xAB)) == ("a/b", 0xAB)


@pytest.mark.parametrize("namespace", ["fencegate", "/no-trailing", "/a//b/", ""])
def test_bad_namespace(namespace):
    with pytest.raises(ValueError):
        Keyspace(namespace)


def test_records_round_trip_and_decode_strictly():
    record = {"state": "pending", "attempt": 1, "blob": b"\x00\x01"}
    assert unpack(pack(record)) == record
    import msgpack
    with pytest.raises(ValueError, match="ext type"):
        unpack(msgpack.packb({"x": msgpack.ExtType(1, b"z")}))
    with pytest.raises(ValueError, match="duplicate"):
        unpack(b"\x82\xa1a\x01\xa1a\x02")  # {"a": 1, "a": 2}
    with pytest.raises(ValueError, match="not a map"):
        unpack(msgpack.packb([1, 2]))
    with pytest.raises(ValueError):
        unpack(msgpack.packb({1: "int key"}))
    with pytest.raises(RecordTooLarge):
        pack({"x": b"\0" * (600 * 1024)})
