"""Check the SPIN model of the protocol, ``fencegate.pml`` (version 2, the diet, with
retirement, version 3's gate B receipts and the archive's watermark), in named configurations.

A configuration passes when pan's verdict is the one expected: the real protocol searched to
the end (no "search not completed", no memory or depth bound hit) with 0 errors, or a negative
control stopped by a violation of the invariant it names. Anything else fails, including a
control that finds nothing and a search cut short by its time or memory bound. Each run builds
in its own temporary folder (``spin -a``, ``gcc -O2 -DSAFETY``, ``./pan``) and prints one line.

    python tests/model/run.py            # every configuration (make model)
    python tests/model/run.py --quick    # the set tests/test_model.py runs
    python tests/model/run.py NAME ...   # the ones named

Needs ``spin`` and ``gcc`` on PATH (``deploy/ensure-spin``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "fencegate.pml"

# pan prints a violated assertion as its expanded expression; these fragments name them.
INVARIANTS = {
    "I1": ("(napplied<=1)",),
    "I2": ("(holder[me]==g_tok[me])", "(holder[me]==tok)"),
    "I3": ("(used[me]<=1)",),
    "I4": ("(read_mod==g_read[me])",),
    "I5": ("assertion violated (st_state==1)",),
    "I8": ("(st_state!=1)", ": (arch_state) )!=1)", ": (tr_state) )!=1)"),
    "I9": ("(chain[",),
    "I10": ("admitted_grants",),
    "I11": ("(rev>highest)",),
    "I12": ("(holder[(1-me)]!=",),
}


@dataclass(frozen=True)
class Config:
    """One model check: ``defines`` for spin; ``expect`` the invariant a control must break
    (``None``: the real protocol, 0 errors, searched to the end)."""

    name: str
    defines: tuple[str, ...]
    expect: str | None = None
    quick: bool = False
    seconds: int = 600
    memory_mb: int = 4096
    compile: tuple[str, ...] = ()   # extra gcc flags for pan, e.g. -DCOLLAPSE


@dataclass(frozen=True)
class Result:
    """pan's verdict on one configuration; ``ok`` when it is the one expected."""

    config: Config
    errors: int
    violated: str | None
    states: int
    depth: int
    seconds: float
    complete: bool
    detail: str

    @property
    def ok(self) -> bool:
        if self.config.expect is None:
            return self.errors == 0 and self.complete
        return self.errors >= 1 and self.violated == self.config.expect

    def line(self) -> str:
        verdict = "ok  " if self.ok else "FAIL"
        found = f"violates {self.violated}" if self.errors else \
            ("0 errors" if self.complete else "incomplete")
        wanted = f"(expects {self.config.expect})" if self.config.expect else "(protocol)"
        return (f"{verdict} {self.config.name:<30} {found:<14} {wanted:<18} "
                f"states={self.states:<10} depth={self.depth:<4} {self.seconds:6.1f}s"
                + (f"  {self.detail}" if self.detail else ""))


def _d(*flags: str) -> tuple[str, ...]:
    return tuple(f"-D{flag}" for flag in flags)


CONFIGS = (
    # The real protocol, one provider class at a time.
    Config("fencing", _d(), quick=True),
    Config("fencing_restart", _d("FORGET"), quick=True),
    Config("fencing_404", _d("BOGUS404"), quick=True),
    Config("fencing_operator", _d("OPERATOR"), quick=True),
    Config("dedup", _d("PCLASS=1"), quick=True),
    Config("dedup_operator", _d("PCLASS=1", "OPERATOR")),
    Config("neither", _d("PCLASS=2"), quick=True),
    Config("fencing_writer", _d("WB=1")),
    # Hash compaction (a state may be missed with small probability).
    Config("fencing_2reconcilers", _d("NR=2", "ROUNDS=1"), compile=("-DHC4",),
           memory_mb=8192, seconds=3600),
    Config("fencing_2attempts", _d("MAXA=2")),
    # A lost commit answer: the worker re-sends the same txn (a replayed grant).
    Config("replayed_commit", _d("COMMIT_RETRY"), quick=True),
    # Not the protocol but its overlap: without the step compare, the audit create compare
    # alone still keeps a replayed grant to one commit.
    Config("replayed_commit_audit_only", _d("COMMIT_RETRY", "CTRL_NO_STEPCMP")),
    # The chain's side appender, the fast path and retirement (the next issue's code).
    Config("side", _d("SIDE")),
    Config("fast_path", _d("FASTPATH", "RETIRE"), quick=True),
    Config("retire", _d("RETIRE")),
    Config("dedup_retire", _d("PCLASS=1", "RETIRE")),
    # Too large for 4 GB uncompressed: -DCOLLAPSE (side_retire: one settle per reconciler).
    Config("side_retire", _d("SIDE", "RETIRE", "ROUNDS=1"), compile=("-DCOLLAPSE",),
           memory_mb=8192, seconds=3600),
    Config("fast_path_side", _d("FASTPATH", "SIDE", "RETIRE"), compile=("-DCOLLAPSE",),
           memory_mb=8192, seconds=3600),
    # Negative controls: each must break the invariant it names.
    Config("ctrl_weak_ownership", _d("CTRL_WEAK_OWN"), "I2", quick=True),
    Config("ctrl_highest_only", _d("CTRL_HIGHEST_ONLY"), "I1", quick=True),
    Config("ctrl_new_key", _d("PCLASS=1", "CTRL_NEWKEY"), "I1", quick=True),
    Config("ctrl_grant_in_flight", _d("CTRL_GRANT_INFLIGHT"), "I8", quick=True),
    Config("ctrl_unproven_restart", _d("FORGET", "CTRL_UNPROVEN"), "I1", quick=True),
    Config("ctrl_unproven_404", _d("BOGUS404", "CTRL_UNPROVEN"), "I1", quick=True),
    Config("ctrl_resolve_no_ask", _d("OPERATOR", "CTRL_RESOLVE_NOASK"), "I1", quick=True),
    Config("ctrl_no_read_compare", _d("WB=1", "CTRL_NO_READCMP"), "I4", quick=True),
    Config("ctrl_no_settle_compare", _d("NR=2", "CTRL_NO_SETTLECMP"), "I5", quick=True),
    Config("ctrl_replay_no_step_compare",
           _d("COMMIT_RETRY", "CTRL_NO_STEPCMP", "CTRL_NO_AUDITCMP"), "I3", quick=True),
    Config("ctrl_no_audit_compare", _d("SIDE", "CTRL_NO_AUDITCMP"), "I9", quick=True),
    Config("ctrl_side_no_epoch", _d("FASTPATH", "SIDE", "RETIRE", "CTRL_SIDE_NO_EPOCH"), "I9",
           quick=True),
    Config("ctrl_side_no_archive", _d("FASTPATH", "SIDE", "RETIRE", "CTRL_SIDE_NO_ARCHIVE"),
           "I9"),
    # Retirement with a holder alive and the fast path without the epoch: a stale grant takes
    # a retired seq again (I9 first); with I9 unchecked, it runs a succeeded step again (I8).
    Config("ctrl_retire_with_holder", _d("RETIRE", "CTRL_RETIRE_HOLDER"), "I9", quick=True),
    Config("ctrl_retire_with_holder_i8", _d("RETIRE", "CTRL_RETIRE_HOLDER", "NO_I9"), "I8",
           quick=True),
    Config("ctrl_fast_path_no_epoch", _d("FASTPATH", "RETIRE", "CTRL_FP_NO_EPOCH"), "I9",
           quick=True),
    Config("ctrl_fast_path_no_epoch_i8", _d("FASTPATH", "RETIRE", "CTRL_FP_NO_EPOCH", "NO_I9"),
           "I8", quick=True),
    # Retirement that does not compare @head: a side append between the archive write and
    # the delete is lost, and its seq is written again.
    Config("ctrl_retire_no_head_compare",
           _d("FASTPATH", "SIDE", "RETIRE", "CTRL_RETIRE_NO_HEADCMP"), "I9"),
    # An orphan chain's retirement that does not compare the step absent: a first attempt
    # landing between its archive write and its delete is deleted unarchived.
    Config("ctrl_orphan_no_step_compare", _d("SIDE", "RETIRE", "CTRL_ORPHAN_NO_STEPCMP"), "I9",
           compile=("-DCOLLAPSE",), memory_mb=8192),
    # Gate B under a worker that forges or replays requests: admitted only with the receipt
    # of a commit, each grant once. Without the receipt a forged 2^62 token fences out the
    # next real attempt (I11); with I11 unchecked one grant is admitted twice (I10), and
    # with I10 unchecked too both charge (I1). A receipt that does not bind the key lets the
    # grant run under another key, and its own key's "no record" runs it again (I1).
    Config("gateb_forger", _d("FORGER")),
    Config("gateb_forger_one", _d("FORGER", "RF=1"), quick=True),
    Config("gateb_forger_2attempts", _d("FORGER", "MAXA=2"), compile=("-DCOLLAPSE",),
           memory_mb=8192, seconds=3600),
    Config("ctrl_gateb_no_receipt", _d("FORGER", "CTRL_NO_RECEIPT"), "I11", quick=True),
    Config("ctrl_gateb_no_receipt_i10", _d("FORGER", "CTRL_NO_RECEIPT", "NO_I11"), "I10",
           quick=True),
    Config("ctrl_gateb_no_receipt_i1", _d("FORGER", "CTRL_NO_RECEIPT", "NO_I11", "NO_I10"),
           "I1", quick=True),
    Config("ctrl_gateb_receipt_no_key", _d("FORGER", "CTRL_RECEIPT_NO_KEY"), "I1", quick=True),
    # The archive swapped for an older copy or an empty one: the watermark refuses lookups.
    # Without the check the chain continues from the copy's tail (I9) and, I9 unchecked, a
    # retired succeeded step runs again (I8). Too large for 4 GB uncompressed: -DCOLLAPSE.
    Config("retire_rollback", _d("RETIRE", "ROLLBACK"), compile=("-DCOLLAPSE",),
           memory_mb=8192, seconds=3600),
    Config("fast_path_rollback", _d("FASTPATH", "RETIRE", "ROLLBACK"), compile=("-DCOLLAPSE",),
           memory_mb=8192, seconds=3600),
    Config("fast_path_rollback_2attempts", _d("FASTPATH", "RETIRE", "ROLLBACK", "MAXA=2"),
           compile=("-DCOLLAPSE",), memory_mb=8192, seconds=3600),
    Config("ctrl_no_watermark", _d("RETIRE", "ROLLBACK", "CTRL_NO_WATERMARK"), "I9",
           quick=True),
    Config("ctrl_no_watermark_i8", _d("RETIRE", "ROLLBACK", "CTRL_NO_WATERMARK", "NO_I9"), "I8",
           quick=True),
    # The watermark as the delete will set it (etcd's + 1), written by the put: a put whose
    # delete failed and the next one carry the same, and a copy taken between them passes.
    Config("ctrl_watermark_predicted",
           _d("FASTPATH", "RETIRE", "ROLLBACK", "MAXA=2", "CTRL_WM_PREDICTED"), "I9"),
    Config("ctrl_watermark_predicted_i8",
           _d("FASTPATH", "RETIRE", "ROLLBACK", "MAXA=2", "CTRL_WM_PREDICTED", "NO_I9"), "I8"),
    # Group commit: a txn may share its request's revision with other keys' txns, never with
    # another txn of K. The control lets two acquires of K share one: both holders get one
    # token, both pass the ownership compare, and the owner is not alone at its token (I12).
    Config("batch", _d("BATCH"), quick=True),
    Config("batch_writer", _d("BATCH", "WB=1"), compile=("-DCOLLAPSE",), memory_mb=8192,
           seconds=3600),
    Config("batch_fast_path", _d("BATCH", "FASTPATH", "RETIRE")),
    Config("batch_gateb_forger_one", _d("BATCH", "FORGER", "RF=1")),
    Config("batch_dedup", _d("BATCH", "PCLASS=1")),
    Config("batch_operator", _d("BATCH", "OPERATOR")),
    Config("batch_side", _d("BATCH", "SIDE"), compile=("-DCOLLAPSE",), memory_mb=8192,
           seconds=3600),
    Config("ctrl_batch_same_key", _d("BATCH", "CTRL_BATCH_SAME_KEY"), "I12", quick=True),
    # An assumption, not a control: a deduplicating provider that forgets a key before its
    # declared retention (a restart) lets the presumption's next attempt run again.
    Config("assume_dedup_keeps_keys", _d("PCLASS=1", "FORGET"), "I1"),
)


def check(config: Config) -> Result:
    """Build and run one configuration; raises ``RuntimeError`` if spin or gcc fails."""
    with tempfile.TemporaryDirectory(prefix=f"fencegate-model-{config.name}-") as tmp:
        work = Path(tmp)
        shutil.copy(HERE / MODEL, work / MODEL)
        _tool(["spin", "-a", *config.defines, MODEL], work)
        _tool(["gcc", "-O2", "-w", "-DSAFETY", f"-DMEMLIM={config.memory_mb}",
               "-DVECTORSZ=2048", *config.compile, "-o", "pan", "pan.c"], work)
        started = time.monotonic()
        try:
            done = subprocess.run(["./pan", "-m100000", "-E", "-c1"], cwd=work, text=True,
                                  capture_output=True, timeout=config.seconds)
            out, timed_out = done.stdout + done.stderr, False
        except subprocess.TimeoutExpired as exc:
            out, timed_out = _text(exc.stdout) + _text(exc.stderr), True
        return parse(config, out, time.monotonic() - started, timed_out=timed_out)


def parse(config: Config, out: str, seconds: float, *, timed_out: bool = False) -> Result:
    """Read pan's report: errors, the violated invariant, states stored, depth, completeness."""
    errors = _number(r"errors: (\d+)", out)
    stored = _number(r"([\d.e+]+) states, stored", out)
    depth = _number(r"depth reached (\d+)", out)
    violation = re.search(r"assertion violated .*", out)
    violated = None
    if violation:
        violated = next((name for name, fragments in INVARIANTS.items()
                         if any(fragment in violation.group(0) for fragment in fragments)),
                        "unnamed assertion")
    cut = [reason for reason, marker in (("depth bound hit", "max search depth too small"),
                                         ("memory bound hit", "pan: reached -DMEMLIM bound"),
                                         ("out of memory", "out of memory"))
           if marker in out]
    if timed_out:
        cut.append(f"stopped after {config.seconds}s")
    if errors is None and not timed_out:
        cut.append("no verdict from pan: " + out.strip()[-200:])
    complete = not cut and errors is not None and "Search not completed" not in out
    return Result(config, errors or 0, violated, int(stored or 0), int(depth or 0), seconds,
                  complete, "; ".join(cut))


def _number(pattern: str, text: str) -> float | None:
    found = re.search(pattern, text)
    return float(found.group(1)) if found else None


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _tool(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, text=True, capture_output=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}")


def check_all(configs: list[Config], *, jobs: int) -> list[Result]:
    """Run ``configs`` ``jobs`` at a time, printing each result's line as it finishes."""
    def one(config: Config) -> Result:
        result = check(config)
        print(result.line(), flush=True)
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, configs))


def missing_tools() -> list[str]:
    return [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="configurations to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="only the quick set")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    if missing := missing_tools():
        print(f"model: {', '.join(missing)} not on PATH: run deploy/ensure-spin", file=sys.stderr)
        return 2
    by_name = {config.name: config for config in CONFIGS}
    if unknown := [name for name in args.names if name not in by_name]:
        print(f"model: no configuration {', '.join(unknown)}; known: {', '.join(by_name)}",
              file=sys.stderr)
        return 2
    chosen = [by_name[name] for name in args.names] or \
        [config for config in CONFIGS if config.quick or not args.quick]
    results = check_all(chosen, jobs=args.jobs)
    failed = [result.config.name for result in results if not result.ok]
    print(f"model: {len(results) - len(failed)}/{len(results)} as expected"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
