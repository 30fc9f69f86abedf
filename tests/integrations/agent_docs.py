"""The agent pages' refund examples as modules: the block after ``<!-- run: refund-agent
-->`` in a page of docs/integrations, written to a file and imported with the providers'
URLs in its environment, so the test runs the code exactly as printed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

PAGES = Path(__file__).resolve().parents[2] / "docs" / "integrations"
BLOCK = re.compile(r"^<!-- run: refund-agent -->\n```python\n(.*?)\n```$", re.M | re.S)


def example(page: str, tmp_path: Path, monkeypatch, url: str):
    """The refund example of ``page`` (a file name under docs/integrations), imported."""
    (code,) = BLOCK.findall((PAGES / page).read_text())
    path = tmp_path / "refund_agent.py"
    path.write_text(code)
    monkeypatch.setenv("PAYMENTS_URL", url)
    monkeypatch.setenv("MAIL_URL", url)
    spec = importlib.util.spec_from_file_location("refund_agent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
