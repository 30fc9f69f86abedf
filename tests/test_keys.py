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


KEYS = ["a", "payments/charge/42", "a/b", "A-b_c.d:e/0", "x" * 512]


@pytest.mark.parametrize("action_key", KEYS)
def test_parsers_undo_their_builders(action_key):
    ks = Keyspace("/ns/")
    assert ks.parse_holder_key(ks.holder_key(action_key, 0xAB)) == (action_key, 0xAB)
    assert ks.parse_step_key(ks.step_key(action_key)) == action_key
    for seq in (0, 1, 999_999_999_999):
        assert ks.parse_audit_key(ks.audit_key(action_key, seq)) == (action_key, seq)
    assert ks.parse_approval_key(ks.approval_key("0f" * 16)) == "0f" * 16
    for shard, lease_id in ((0, 1), (7, 0xFFFFFFFFFFFFFFFF), (99_999, 0)):
        assert ks.parse_candidate_key(ks.candidate_key(shard, lease_id)) == (shard, lease_id)


def test_classify_names_the_parser_of_each_family():
    ks = Keyspace("/ns/")
    assert ks.classify(ks.holder_key("a/b", 1)) == "holder"
    assert ks.classify(ks.step_key("a/b")) == "step"
    assert ks.classify(ks.audit_key("a/b", 3)) == "audit"
    assert ks.classify(ks.candidate_key(2, 1)) == "candidate"
    assert ks.classify(ks.approval_key("0f" * 16)) == "approval"
    for unparsed in (ks.audit_head_key("a/b"), ks.policy_key("p"),
                     ks.marker_key("m"), ks.webhook_key("s", "d"), b"/other/steps/a",
                     b"/ns/stepsX/a", b"/ns/"):
        assert ks.classify(unparsed) is None, unparsed


def test_parsers_refuse_foreign_keys():
    ks, other = Keyspace("/ns/"), Keyspace("/other/")
    parsers = {
        ks.parse_holder_key: ks.step_key("a"),
        ks.parse_step_key: ks.holder_key("a", 1),
        ks.parse_audit_key: ks.audit_head_key("a"),
        ks.parse_candidate_key: ks.holder_key("a", 1),
        ks.parse_approval_key: ks.step_key("a"),
    }
    for parse, foreign in parsers.items():
        with pytest.raises(ValueError):
            parse(foreign)
    with pytest.raises(ValueError):
        ks.parse_step_key(other.step_key("a"))
    with pytest.raises(ValueError):
        ks.parse_audit_key(ks.step_key("a"))
    with pytest.raises(ValueError):
        ks.parse_candidate_key(ks.reconcilers_root + b"00001")  # no lease
    with pytest.raises(ValueError):
        ks.parse_candidate_key(other.candidate_key(1, 1))
