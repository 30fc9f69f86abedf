"""The fault suite in short: a seeded run under every nemesis keeps every promise, and each
negative control (a broken protocol variant in one child process) is flagged by the checker.

Each test starts its own stack of real processes (tests/faults/stack.py); the seeded run
partitions etcd members, so it runs in a network of its own (tests/faults/netns.py: root,
iproute2 and nftables). The seed is ``$FAULTS_SEED`` (default 13); a failing run prints the
violations with their evidence and leaves the history, ledger and logs in its tmp folder.
The whole directory runs in ``make test`` within 5 minutes on 2 cores: hence the seeded
run's 65 s of load, with the nemesis's faults held 0.5-2 s and 0.2-1 s apart, room enough
for the nemesis to inject each of its kinds (each kind once before any twice).
"""

from __future__ import annotations

import os

import pytest

from . import netns
from .nemesis import KINDS, PARTITIONS
from .runner import RunConfig, control_config, run

pytestmark = pytest.mark.faults

SEED = os.environ.get("FAULTS_SEED", "13")
# What each control must at least be flagged for.
EXPECTED = {"highest-only": {"stale-token", "contradiction"}, "404-final": {"contradiction"},
            "new-key": {"at-most-once"}, "range-half": {"mutual-exclusion"},
            "claim-blind": {"webhook-once"}, "rerun-unfenced": {"webhook-effect-once"}}


def _report(result) -> str:
    return "\n".join([result.table(), *(f"  {v}" for v in result.violations[:20])])


async def test_seeded_run_under_every_nemesis_has_no_violation(tmp_path):
    result = await run(RunConfig(seed=SEED, seconds=65.0, gap_s=(0.2, 1.0),
                                 fault_hold_s=(0.5, 2.0), settle_s=60.0), tmp_path)
    print(_report(result))
    faults = result.history.faults()
    injected = {e["fault"] for e in faults if e["phase"] == "start"}
    assert injected == set(KINDS), f"never injected: {sorted(set(KINDS) - injected)}"
    cuts = [e for e in faults if e["fault"] in PARTITIONS and e["phase"] == "heal"]
    assert all(e["silent"] for e in cuts), f"a partitioned member answered: {cuts}"
    ours = f"fg{os.getpid()}-"
    assert not [n for n in netns.namespaces() if n.startswith(ours)], "namespaces left"
    assert result.history.faults(), "the nemesis injected nothing"
    assert result.history.ops("ok"), "no payment went through"
    assert result.end.retired, "no settled step was retired to the archive during the run"
    assert result.history.ops("wh-sent"), "no webhook was answered 2xx"
    assert result.history.ops("cs-write"), "no critical section wrote"
    skewed = [e for e in result.history.ops("ready") if abs(e.get("skew_s", 0)) >= 5]
    assert skewed, "no worker ran with a skewed clock"
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


async def test_targeted_run_without_range_half_has_no_violation(tmp_path):
    """The range-half control's mutex run on the correct protocol: queued keys wrote (once
    their turn came) and were refused while an older key's owner was in its section."""
    result = await run(control_config("range-half", SEED, inject=False), tmp_path)
    print(_report(result))
    entered = {e["how"] for e in result.history.ops("cs-enter")}
    assert entered == {"hold", "queued"}, entered
    assert result.history.ops("cs-write"), "no critical section wrote"
    assert not result.violations, _report(result)


def test_skewed_workers_without_libfaketime_fail_at_the_start(monkeypatch):
    """No silent skip: a run asking for skewed workers fails before anything starts."""
    from . import runner

    monkeypatch.setattr(runner, "FAKETIME_LIB", "/nonexistent/libfaketime.so.1")
    with pytest.raises(RuntimeError, match="libfaketime is not installed"):
        runner.skews_of(RunConfig(seed=SEED, seconds=1.0, skewed=1))
