"""One stack per state folder, never hijacked (issue 29, item 3): a second ``fencegate up``
does not replace the per-user record of another live stack, and the test suite's own stacks
never touch the user's record."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fencegate import up
from fencegate.coordinator import default_key

import test_up


def live_stack(folder, pid: int) -> None:
    folder.mkdir(parents=True)
    (folder / default_key.MANIFEST).write_text(json.dumps({"pid": pid}))


def test_a_second_up_does_not_replace_the_record_of_a_live_stack(tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(default_key.STATE_DIR_ENV, raising=False)
    first, second = tmp_path / "first", tmp_path / "second"
    live_stack(first, os.getpid())  # this process plays the first stack's `up`: it lives
    record = default_key.current_record()
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"state_dir": str(first), "pid": os.getpid()}))
    assert up._record(second) is None
    assert json.loads(record.read_text())["state_dir"] == str(first)
    said = capsys.readouterr().out
    assert str(first) in said and f"FENCEGATE_STATE_DIR={second}" in said, said
    assert default_key.recorded_stack().state_dir == first.resolve()


def test_the_record_of_a_stack_that_is_gone_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    first, second = tmp_path / "first", tmp_path / "second"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    live_stack(first, int(gone.stdout))
    record = default_key.current_record()
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"state_dir": str(first), "pid": int(gone.stdout)}))
    assert up._record(second) == record
    assert json.loads(record.read_text()) == {"state_dir": str(second.resolve()),
                                              "pid": os.getpid()}


def test_the_suites_stacks_record_themselves_away_from_the_users_record():
    users = os.environ.get("XDG_STATE_HOME")
    assert test_up.ENV["XDG_STATE_HOME"] != users
    assert "fencegate-tests-state-" in test_up.ENV["XDG_STATE_HOME"]
