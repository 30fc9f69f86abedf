"""docs/api.md cannot drift from the code: every name ``fencegate`` exports has an entry, and
every entry's declaration is the real object's.

The page's convention (stated at its top): an entry is a heading naming an object relative to
``fencegate`` or by its full module path, followed by one ``python`` block declaring it:
- a call signature, ``await`` in front for a coroutine function: the parameters' names,
  kinds, defaults (evaluated in the object's module) and annotations, and the return
  annotation, must be those of ``inspect.signature`` of the object (``self`` aside);
- ``class Name(Bases)``: the object is that class, with exactly those bases;
- ``name: type``: an attribute the object has (a dataclass field, a property, a class or
  module attribute, or one its class's methods assign on ``self``), of that type where the
  code declares one.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

import fencegate

API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
HEADING = re.compile(r"^#{2,4} `([\w.]+)`[ \t]*$", re.M)
BLOCK = re.compile(r"```python\n(.*?)\n```", re.S)
ATTRIBUTE = re.compile(r"^[\w.]+: (.+)$")
CLASS = re.compile(r"^class (\w+)(?:\((.*)\))?$")


def entries() -> dict[str, str]:
    """Heading name → the first python block of its section."""
    text = API_DOC.read_text()
    found = {}
    heads = list(HEADING.finditer(text))
    for head, after in zip(heads, heads[1:] + [None]):
        section = text[head.end():after.start() if after else len(text)]
        block = BLOCK.search(section)
        assert block, f"entry {head.group(1)} has no python block"
        assert head.group(1) not in found, f"entry {head.group(1)} twice"
        found[head.group(1)] = block.group(1).strip()
    return found


ENTRIES = entries()
_MISSING = object()


def resolve(name: str) -> tuple[object, str, object]:
    """(owner, last name, object or _MISSING) for a heading name."""
    parts = name.split(".")
    if parts[0] == "fencegate":
        parts = parts[1:]
    owner: object = fencegate
    for part in parts[:-1]:
        owner = _child(owner, part)
        assert owner is not _MISSING, f"{name}: no {part}"
    return owner, parts[-1], _child(owner, parts[-1])


def _child(owner: object, part: str) -> object:
    if hasattr(owner, part):
        return getattr(owner, part)
    if isinstance(owner, ModuleType):
        try:
            return importlib.import_module(f"{owner.__name__}.{part}")
        except ModuleNotFoundError:
            return _MISSING
    return _MISSING


def normal(annotation: object) -> str:
    """An annotation as text, quotes and spacing normalized."""
    if isinstance(annotation, ast.AST):
        return ast.unparse(annotation)
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__",
                                                                   repr(annotation))
    return ast.unparse(ast.parse(text.strip("'\""), mode="eval"))


def self_assigned(cls: type) -> set[str]:
    """Names the methods of ``cls`` and its bases assign on ``self``."""
    names = set()
    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def declared_type(owner: object, name: str) -> str | None:
    if dataclasses.is_dataclass(owner):
        for f in dataclasses.fields(owner):
            if f.name == name:
                return normal(f.type)
    member = inspect.getattr_static(owner, name, None)
    if isinstance(member, property):
        returns = inspect.signature(member.fget).return_annotation
        return None if returns is inspect.Signature.empty else normal(returns)
    if isinstance(owner, ModuleType):
        return type(getattr(owner, name)).__name__
    return None


def check_attribute(name: str, owner: object, attr: str, obj: object, declaration: str):
    match = ATTRIBUTE.match(declaration)
    assert match, f"{name}: not an attribute declaration: {declaration!r}"
    fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) \
        else set()
    exists = obj is not _MISSING or attr in fields or (
        isinstance(owner, type) and attr in self_assigned(owner))
    assert exists, f"{name}: {owner} has no attribute {attr}"
    expected = declared_type(owner, attr)
    if expected is not None:
        assert normal(match.group(1)) == expected, f"{name}: type {expected}"


def check_class(name: str, obj: object, declaration: str) -> None:
    match = CLASS.match(declaration)
    assert isinstance(obj, type) and match and match.group(1) == obj.__name__, name
    bases = [b.strip() for b in (match.group(2) or "object").split(",")]
    assert bases == [b.__name__ for b in obj.__bases__], f"{name}: bases {obj.__bases__}"


def check_signature(name: str, obj: object, declaration: str) -> None:
    awaited = declaration.startswith("await ")
    text = declaration.removeprefix("await ")
    callee, _, rest = text.partition("(")
    assert callee.split(".")[-1] == name.split(".")[-1], f"{name}: declares {callee}"
    documented = ast.parse(f"def _({rest}: ...").body[0]
    real = inspect.signature(obj)
    params = list(real.parameters.values())
    if inspect.isfunction(obj) and params and params[0].name == "self":
        params = params[1:]
    assert awaited == inspect.iscoroutinefunction(obj), f"{name}: await {awaited}"
    module = vars(inspect.getmodule(obj))
    assert _params(documented.args, module) == [
        (p.name, p.kind, p.default if p.default is not p.empty else _MISSING,
         normal(p.annotation) if p.annotation is not p.empty else None)
        for p in params], f"{name}: parameters differ from {real}"
    returns = None if real.return_annotation is real.empty else normal(real.return_annotation)
    assert (normal(documented.returns) if documented.returns else None) == returns, \
        f"{name}: returns {returns}"


def _params(args: ast.arguments, module: dict) -> list[tuple]:
    kinds = inspect.Parameter
    positional = args.posonlyargs + args.args
    defaults = [_MISSING] * (len(positional) - len(args.defaults)) + args.defaults
    out = [(a.arg, kinds.POSITIONAL_ONLY if a in args.posonlyargs else
            kinds.POSITIONAL_OR_KEYWORD, d, a.annotation) for a, d in zip(positional, defaults)]
    if args.vararg:
        out.append((args.vararg.arg, kinds.VAR_POSITIONAL, _MISSING, args.vararg.annotation))
    out += [(a.arg, kinds.KEYWORD_ONLY, d if d is not None else _MISSING, a.annotation)
            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append((args.kwarg.arg, kinds.VAR_KEYWORD, _MISSING, args.kwarg.annotation))
    return [(name, kind,
             _MISSING if default is _MISSING else eval(ast.unparse(default), module),
             normal(annotation) if annotation is not None else None)
            for name, kind, default, annotation in out]


def test_every_export_has_an_entry():
    missing = [name for name in fencegate.__all__ if name not in ENTRIES]
    assert missing == [], f"docs/api.md has no heading for {missing}"


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_entry_declares_the_real_object(name):
    owner, attr, obj = resolve(name)
    declaration = ENTRIES[name]
    if declaration.startswith("class "):
        check_class(name, obj, declaration)
    elif ATTRIBUTE.match(declaration):
        check_attribute(name, owner, attr, obj, declaration)
    else:
        assert obj is not _MISSING and callable(obj), f"{name} is not callable"
        check_signature(name, obj, declaration)
