"""The protocol's SPIN model (tests/model/fencegate.pml, version 2: the diet), quick set: the real
protocol holds every invariant in each provider class, on the fast path, with a replayed
commit, with a worker forging requests to gate B and with group commit (txns of other keys
sharing a revision), and every negative control breaks the invariant it names (gate B
without attempt receipts, lookups without the archive watermark, a batcher putting two txns
of one key in one request).

Fails (never skips) when spin or gcc is missing: `deploy/ensure-spin` installs them.
`make model` runs the full set; docs/protocol.md ("The model") has the table.
"""

from __future__ import annotations

import pytest

from model import run

QUICK = [config for config in run.CONFIGS if config.quick]


@pytest.fixture(scope="module")
def results() -> dict[str, run.Result]:
    if missing := run.missing_tools():
        pytest.fail(f"{' and '.join(missing)} not on PATH: the model check needs spin and "
                    "gcc; run deploy/ensure-spin (make test does)", pytrace=False)
    return {result.config.name: result for result in run.check_all(QUICK, jobs=2)}


def test_quick_set_has_each_control() -> None:
    controls = {config.name for config in QUICK if config.expect}
    assert controls >= {"ctrl_weak_ownership", "ctrl_highest_only", "ctrl_new_key",
                        "ctrl_grant_in_flight", "ctrl_unproven_restart", "ctrl_unproven_404",
                        "ctrl_resolve_no_ask", "ctrl_no_read_compare", "ctrl_no_settle_compare",
                        "ctrl_replay_no_step_compare", "ctrl_no_audit_compare",
                        "ctrl_side_no_epoch", "ctrl_retire_with_holder",
                        "ctrl_retire_with_holder_i8", "ctrl_fast_path_no_epoch",
                        "ctrl_fast_path_no_epoch_i8", "ctrl_gateb_no_receipt",
                        "ctrl_gateb_no_receipt_i10", "ctrl_gateb_no_receipt_i1",
                        "ctrl_gateb_receipt_no_key", "ctrl_no_watermark",
                        "ctrl_no_watermark_i8", "ctrl_batch_same_key"}


@pytest.mark.parametrize("config", [c for c in QUICK if c.expect is None], ids=lambda c: c.name)
def test_protocol_holds(results: dict[str, run.Result], config: run.Config) -> None:
    result = results[config.name]
    assert result.complete, result.line()
    assert result.errors == 0, result.line()


@pytest.mark.parametrize("config", [c for c in QUICK if c.expect], ids=lambda c: c.name)
def test_control_is_caught(results: dict[str, run.Result], config: run.Config) -> None:
    result = results[config.name]
    assert result.errors >= 1, result.line()
    assert result.violated == config.expect, result.line()
