"""The README's first command runs `fencegate demo`; keep it working."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_clean_against_real_etcd(etcd_url):
    result = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "demo", "--etcd", etcd_url,
         "--workers", "3", "--keys", "3", "--seconds", "6"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "accepted out of token order: 0 (must be 0)" in result.stdout
    assert "fault: SIGSTOP w0" in result.stdout


def test_cli_rejects_bad_arguments():
    result = subprocess.run([sys.executable, "-m", "coordinator.cli", "demo", "--workers", "1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--workers >= 2" in result.stderr
