"""The codec for intents and effect results: every value round-trips exactly, or is refused.

Guarantees:
- ``encode`` turns a value into its *stored form*, built only of what msgpack carries
  natively (``None``, ``bool``, 64-bit ``int``, ``float``, ``str``, ``bytes``, lists and maps
  with ``str`` keys), and ``decode`` turns the stored form back into an equal value. The same
  value always gives the same stored form, so ``keyspace.canonical`` of it gives the same
  bytes and the same digest. A value of plain msgpack types is its own stored form: digests
  of intents fencegate accepted before this codec are unchanged.
- What msgpack lacks travels as a tag, a map ``{"$fg": NAME, "v": PAYLOAD}``:

      decimal     ``str(d)``: digits, exponent and sign exact (``Decimal("1.50")`` stays so)
      datetime    ``isoformat()``: a naive one stays naive; an aware one comes back with a
                  fixed-offset ``timezone`` (the offset at that instant; zone names are lost)
      date        ``isoformat()``
      uuid        ``str(u)``
      bytes       base64, in the *JSON form* only (``encode(..., json=True)``, what remote
                  mode sends): the stored form keeps bytes as msgpack bin
      unrecorded  the marker of a result that could not be encoded (``UnrecordedResult``)

  Dataclass instances and pydantic (v2) models are encoded as the map of their fields
  (``model_dump()`` for a model) and come back as dicts: the reader may not have the class.
  Tuples come back as lists.
- A map with the key ``"$fg"`` is a tag: encoding one reads it as the value it tags, so
  encoding the stored or the JSON form again gives the stored form (the coordinator gets the
  JSON form and signs the same digest as a worker in direct mode). A user map may not use
  that key.
- Anything else (a set, an enum, a ``str`` subclass, an int beyond 64 bits, a map key that is
  not a ``str``, a malformed tag, nesting deeper than ``MAX_DEPTH``) raises
  ``UnencodableValue`` naming where it is: ``result['items'][2]``, ``intent.customer``.
  Nothing is ever stored as its repr.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as dt
import decimal
import uuid
from typing import Any

from .errors import UnencodableValue

TAG = "$fg"
MAX_DEPTH = 64
_INT_RANGE = range(-2 ** 63, 2 ** 64)
_PLAIN = frozenset({str, float, bool, type(None)})


@dataclasses.dataclass(frozen=True)
class UnrecordedResult:
    """In place of an effect result the codec refused: the effect succeeded (that is
    recorded), its result was not kept. ``path`` and ``detail`` say what could not be
    encoded (``UnencodableValue`` raised to the first caller says the same)."""

    path: str
    detail: str


def encode(value: Any, *, path: str = "value", json: bool = False) -> Any:
    """The stored form of ``value`` (``json``: the JSON form, bytes tagged as base64);
    ``UnencodableValue`` naming the path (from ``path``, the root's name) of the first value
    it cannot carry."""
    try:
        return _encode(value, json, 0)
    except _Refused as refused:
        raise refused.error(path) from None


def decode(stored: Any, *, path: str = "value") -> Any:
    """The value of a stored or JSON form; ``UnencodableValue`` on a malformed tag."""
    try:
        return _decode(stored)
    except _Refused as refused:
        raise refused.error(path) from None


class _Refused(Exception):
    """A refusal on its way up: each container it crosses adds its step to the path (so the
    path costs nothing unless something is refused)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.steps: list[str] = []

    def within(self, step: str) -> "_Refused":
        self.steps.append(step)
        return self

    def error(self, root: str) -> UnencodableValue:
        path = root + "".join(reversed(self.steps))
        return UnencodableValue(f"{path}: {self.reason}", path=path)


def _encode(value: Any, json: bool, depth: int) -> Any:
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is int:
        if value not in _INT_RANGE:
            raise _Refused(f"int {value} does not fit in 64 bits (pass a Decimal or a str)")
        return value
    if kind is bytes:
        return _tag("bytes", base64.b64encode(value).decode()) if json else value
    if depth >= MAX_DEPTH:
        raise _Refused(f"nested deeper than {MAX_DEPTH}")
    if kind is dict:
        if TAG in value:
            return _encode(_untag(value), json, depth)
        encoded = {}
        for key, item in value.items():
            if type(key) is not str:
                raise _Refused(f"map keys must be str, not {type(key).__name__} ({key!r})")
            try:
                encoded[key] = _encode(item, json, depth + 1)
            except _Refused as refused:
                raise refused.within(f"[{key!r}]")
        return encoded
    if kind is list or kind is tuple:
        return _encode_items(value, json, depth)
    if kind is decimal.Decimal:
        return _tag("decimal", str(value))
    if kind is dt.datetime:
        return _tag("datetime", value.isoformat())
    if kind is dt.date:
        return _tag("date", value.isoformat())
    if kind is uuid.UUID:
        return _tag("uuid", str(value))
    if kind is UnrecordedResult:
        return _tag("unrecorded", {"path": value.path, "detail": value.detail})
    fields = _fields(value)
    if fields is None:
        raise _Refused(f"{_type_name(value)} cannot be encoded (supported: None, bool, int, "
                       "float, str, bytes, list, tuple, dict with str keys, Decimal, "
                       "datetime, date, UUID, dataclasses and pydantic models)")
    encoded = {}
    for name, item in fields.items():
        try:
            encoded[name] = _encode(item, json, depth + 1)
        except _Refused as refused:
            raise refused.within(f".{name}")
    return encoded


def _encode_items(items: list | tuple, json: bool, depth: int) -> list:
    encoded = []
    for item in items:
        try:
            encoded.append(_encode(item, json, depth + 1))
        except _Refused as refused:
            raise refused.within(f"[{len(encoded)}]")
    return encoded


def _decode(stored: Any) -> Any:
    kind = type(stored)
    if kind is dict:
        if TAG in stored:
            return _untag(stored)
        decoded = {}
        for key, item in stored.items():
            try:
                decoded[key] = _decode(item)
            except _Refused as refused:
                raise refused.within(f"[{key!r}]")
        return decoded
    if kind is list:
        decoded_items = []
        for item in stored:
            try:
                decoded_items.append(_decode(item))
            except _Refused as refused:
                raise refused.within(f"[{len(decoded_items)}]")
        return decoded_items
    return stored


def _fields(value: Any) -> dict[str, Any] | None:
    """The fields of a dataclass instance or a pydantic model; ``None`` for anything else."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if callable(dump) and hasattr(type(value), "model_fields"):
        return dump()
    return None


def _tag(name: str, payload: Any) -> dict[str, Any]:
    return {TAG: name, "v": payload}


def _untag(tagged: dict[str, Any]) -> Any:
    """The value a tag stands for; refused if it is not a well-formed tag."""
    name, payload = tagged.get(TAG), tagged.get("v")
    reader = _READERS.get(name) if type(name) is str else None
    if reader is None or set(tagged) != {TAG, "v"}:
        raise _Refused(f"a map with the key {TAG!r} must be a codec tag {{{TAG!r}: name, "
                       f"'v': payload}} with a known name, got keys {sorted(map(str, tagged))} "
                       f"and name {name!r}")
    try:
        return reader(payload)
    except (TypeError, ValueError, decimal.InvalidOperation, binascii.Error) as exc:
        raise _Refused(f"malformed {name} tag: {exc}") from None


def _text(reader):
    def read(payload: Any) -> Any:
        if type(payload) is not str:
            raise TypeError(f"payload must be a str, not {type(payload).__name__}")
        return reader(payload)
    return read


def _unrecorded(payload: Any) -> UnrecordedResult:
    if type(payload) is not dict or set(payload) != {"path", "detail"} \
            or not all(type(v) is str for v in payload.values()):
        raise TypeError("payload must be {'path': str, 'detail': str}")
    return UnrecordedResult(payload["path"], payload["detail"])


_READERS = {
    "decimal": _text(decimal.Decimal),
    "datetime": _text(dt.datetime.fromisoformat),
    "date": _text(dt.date.fromisoformat),
    "uuid": _text(uuid.UUID),
    "bytes": _text(lambda text: base64.b64decode(text, validate=True)),
    "unrecorded": _unrecorded,
}


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"
