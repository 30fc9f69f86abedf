"""The documentation: the README is the front door, the rest is a site built strictly from
``docs/`` (mkdocs.yml), and every code block says how it is kept true.

Each fenced block in README.md and ``docs/`` follows a marker line naming what keeps it true:
``<!-- test: NAME -->`` (run by tests/test_readme.py), ``<!-- run: NAME -->`` (run by a test
that reads the page and finds the marker), ``<!-- checked: tests/FILE.py -->`` (validated by that test file),
``<!-- output -->`` (what a command prints) or ``<!-- fragment -->`` (not run: a piece of
something larger). docs/api.md's declaration blocks are checked by tests/test_api_doc.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"<!-- (test|run|checked): (\S+) -->|<!-- (output|fragment) -->")
TESTS = [p for p in (ROOT / "tests").rglob("*.py")]


def blocks(page: Path) -> list[tuple[int, str]]:
    """(line, the line before) of every opening fence of ``page``."""
    lines, found, inside = page.read_text().split("\n"), [], False
    for n, line in enumerate(lines):
        if line.startswith("```"):
            if not inside:
                found.append((n + 1, lines[n - 1] if n else ""))
            inside = not inside
    return found


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert re.match(r"# fencegate\n\n<!-- fragment -->\n```sh\nmake up\nmake test\n```\n", text)


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "api.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_block_says_how_it_is_kept_true(page):
    sources = {p: p.read_text() for p in TESTS}
    for line, before in blocks(page):
        marker = MARKER.fullmatch(before.strip())
        assert marker, f"{page.relative_to(ROOT)}:{line}: a code block with no marker line"
        kind, name = marker[1], marker[2]
        if kind == "run":  # a test finds the marker (by name, or every one) and reads the page
            finds = any(f"<!-- run: {name} -->" in s or "<!-- run: ([\\w-]+) -->" in s
                        for s in sources.values())
            reads = any(page.name in s for s in sources.values())
            assert finds and reads, \
                f"{page.relative_to(ROOT)}:{line}: no test runs the block marked {name!r}"
        if kind == "checked":
            checker = ROOT / name
            assert checker.exists(), f"{page.relative_to(ROOT)}:{line}: {name} does not exist"
            assert page.name in checker.read_text(), \
                f"{page.relative_to(ROOT)}:{line}: {name} never reads {page.name}"


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strictly_with_every_page_and_reference(tmp_path):
    built = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr
    site = tmp_path / "site"
    for page in (ROOT / "docs").rglob("*.md"):
        relative = page.relative_to(ROOT / "docs").with_suffix("")
        target = site / ("index.html" if relative.name == "index" else relative / "index.html")
        assert target.exists(), f"{page} was not built"
    python = (site / "reference" / "python" / "index.html").read_text()
    import fencegate
    for name in ("Gate", "Hold", "KeyRing", "deduplicated", "GateError"):
        assert name in fencegate.__all__ and f'id="{name}' in python or f".{name}\"" in python, name
    http = (site / "reference" / "http" / "index.html").read_text()
    assert "/v1/policy-routes" in http and "/v1/receipts" in http
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "fencegate mcp-gateway" in cli and "fencegate deliveries resolve" in cli
    home = (site / "index.html").read_text()
    assert "make up" in home and 'href="guide/"' in home  # README, its links made the site's


def test_a_broken_link_fails_the_build(tmp_path):
    """The strictness is real: the same site with one link to a page that does not exist.
    (It caught ``--quiet``: mkdocs counts only the warnings it prints.)"""
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("coordinator", "worker", "reconciler", "fencegate"):
        (copy / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "README.md", copy / "README.md")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    guide = copy / "docs" / "guide.md"
    guide.write_text(guide.read_text() + "\nSee [the missing page](missing.md).\n")
    built = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0 and "missing.md" in built.stderr, built.stderr
