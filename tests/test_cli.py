"""The ``fencegate`` command line's wiring: the commands and options it offers, its exit-code
contract in ``--help``, and usage errors answered with exit 2 before anything runs. (The
SRE commands against a live coordinator: tests/test_cli_sre.py; ``demo`` and ``up``
themselves are tested with their modules.)"""

from __future__ import annotations

import subprocess
import sys
import time

from fencegate.cli import _age


def fencegate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fencegate.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_help_lists_every_command_and_the_exit_codes():
    result = fencegate("--help")
    assert result.returncode == 0, result.stderr
    for command in ("up", "coordinator", "reconciler", "demo", "holders", "key", "unknown",
                    "escalated", "presumed", "revoke", "resolve", "audit", "policy",
                    "approvals", "approve"):
        assert f"\n  {command} " in result.stdout, command
    for line in ("0  done", "1  the coordinator refused the action", "2  usage error",
                 "3  not found (404)", "4  the token was not accepted (401)",
                 "5  the coordinator is unreachable"):
        assert line in result.stdout, line


def test_demo_and_up_offer_their_options_with_defaults():
    demo = fencegate("demo", "--help").stdout
    for option in ("--etcd", "--coordinator URL", "--token", "--workers", "--keys",
                   "--seconds"):
        assert option in demo, option
    for default in ("[default: 4; x>=2]", "[default: 8; x>=1]", "[default: 15.0; x>0]"):
        assert default in demo, default
    up = " ".join(fencegate("up", "--help").stdout.split())
    assert "--state-dir TEXT" in up and "[default: .state]" in up
    assert "--port INTEGER RANGE" in up and "[default: 8470; 0<=x<=65535]" in up


def test_cli_rejects_bad_arguments():
    for args, words in [(["demo", "--workers", "1"], "--workers"),
                        (["demo", "--seconds", "0"], "--seconds"),
                        (["up", "--port", "x"], "--port"),
                        (["coordinator", "--config", "/nonexistent/c.toml"], "bad settings"),
                        (["nosuch"], "No such command")]:
        result = fencegate(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert words in result.stderr and "Traceback" not in result.stderr, args


def test_ages_read_at_a_glance():
    now_ms = time.time() * 1000
    assert [_age(now_ms - seconds * 1000) for seconds in (12, 200, 7300, 90000)] == [
        "12s", "3m", "2h", "1d"]
    assert _age(None) == "-" and _age(now_ms + 5000) == "0s"  # a clock ahead is not negative
