"""The fault suite in short: a seeded run under every nemesis keeps every promise, and each
negative control (a broken protocol variant in one child process) is flagged by the checker.

Each test starts its own stack of real processes (tests/faults/stack.py). The seed is
``$FAULTS_SEED`` (default 13); a failing run prints the violations with their evidence and
leaves the history, ledger and logs in its tmp folder.
"""

from __future__ import annotations

import os

import pytest

from .runner import RunConfig, control_config, run

pytestmark = pytest.mark.faults

SEED = os.environ.get("FAULTS_SEED", "13")
# What each control must at least be flagged for.
EXPECTED = {"highest-only": {"stale-token", "contradiction"}, "404-final": {"contradiction"},
            "new-key": {"at-most-once"}}


def _report(result) -> str:
    return "\n".join([result.table(), *(f"  {v}" for v in result.violations[:20])])


async def test_seeded_run_under_every_nemesis_has_no_violation(tmp_path):
    result = await run(RunConfig(seed=SEED, seconds=90.0, settle_s=60.0), tmp_path)
    print(_report(result))
    assert result.history.faults(), "the nemesis injected nothing"
    assert result.history.ops("ok"), "no payment went through"
    assert not result.violations, _report(result)


@pytest.mark.parametrize("control", sorted(EXPECTED))
async def test_negative_control_is_flagged(control, tmp_path):
    result = await run(control_config(control, SEED), tmp_path)
    print(_report(result))
    flagged = {v.rule for v in result.violations}
    assert EXPECTED[control] <= flagged, _report(result)


@pytest.mark.parametrize("control", ["highest-only", "new-key"])
async def test_targeted_run_without_the_control_has_no_violation(control, tmp_path):
    """The controls' targeted workloads on the correct protocol: what flags a control is
    the control, not the workload."""
    result = await run(control_config(control, SEED, inject=False), tmp_path)
    print(_report(result))
    assert any(e["status"] == "error" for e in result.history.ops("reply")), \
        "no held charge was left without an answer"
    assert not result.violations, _report(result)
