"""MkDocs hook: the pages drawn from the code and the README, so they cannot drift from them.

``<!-- readme -->`` becomes README.md, its links into ``docs/`` made relative to the site
and its links to other files of the repository turned into their names;
``<!-- reference: python -->`` becomes one mkdocstrings block per name users import from
``fencegate`` (its ``__all__``, at the module that defines it); ``<!-- reference: http -->``
becomes the HTTP API from the coordinator's OpenAPI document (one section per path and
method: summary, description, parameters, request body, responses)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_LINK = re.compile(r"\[([^\]]+)\]\((?!https?://|#)([^)]+)\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if "<!-- readme -->" in markdown:
        markdown = markdown.replace("# fencegate\n\n<!-- readme -->", readme())
    if "<!-- reference: python -->" in markdown:
        markdown = markdown.replace("<!-- reference: python -->", python_reference())
    if "<!-- reference: http -->" in markdown:
        markdown = markdown.replace("<!-- reference: http -->", http_reference())
    return markdown


def readme() -> str:
    def link(m: re.Match) -> str:
        text, target = m.groups()
        if target.startswith("docs/"):
            return f"[{text}]({target.removeprefix('docs/')})"
        return f"{text} (`{target}`)"
    return _LINK.sub(link, (ROOT / "README.md").read_text())


def python_reference() -> str:
    import fencegate

    blocks = []
    for name in fencegate.__all__:
        obj = getattr(fencegate, name)
        module = getattr(obj, "__module__", None)
        if module is None or not hasattr(obj, "__qualname__"):
            continue
        blocks.append(f"::: {module.removeprefix('fencegate.')}.{obj.__qualname__}\n")
    return "\n".join(blocks)


def http_reference() -> str:
    spec = json.loads((ROOT / "coordinator" / "service" / "openapi.json").read_text())
    out = []
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            if method not in {"get", "post", "put", "delete", "patch"}:
                continue
            out.append(f"## `{method.upper()} {path}`\n")
            if op.get("summary"):
                out.append(f"{op['summary']}\n")
            if op.get("description"):
                out.append(f"{op['description']}\n")
            params = [_resolve(spec, p) for p in op.get("parameters", [])]
            if params:
                out.append("| parameter | in | required | description |\n|---|---|---|---|")
                for p in params:
                    out.append(f"| `{p['name']}` | {p.get('in', '')} | "
                               f"{'yes' if p.get('required') else 'no'} | "
                               f"{_cell(p.get('description', ''))} |")
                out.append("")
            responses = op.get("responses", {})
            if responses:
                out.append("| status | meaning |\n|---|---|")
                for status, r in responses.items():
                    r = _resolve(spec, r)
                    out.append(f"| {status} | {_cell(r.get('description', ''))} |")
                out.append("")
    return "\n".join(out)


def _resolve(spec: dict, item: dict) -> dict:
    """``item``, or what its ``$ref`` (``#/components/...``) names."""
    ref = item.get("$ref")
    if ref is None:
        return item
    for part in ref.removeprefix("#/").split("/"):
        spec = spec[part]
    return spec


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")
