"""bench/device_check.py: its budget and skip decisions, and a real CPU-only run of its smallest parts that
writes the JSON a device session reads back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.device_check import (
    GPU_CHECKS,
    Part,
    cpu_parts,
    gpu_results,
    gpu_skip_reason,
    parse_parts,
    part_timeout,
)
from tests.harness.procs import REPO, make_env


def test_a_part_runs_for_its_cap_or_what_is_left_and_not_below_its_minimum() -> None:
    part = Part("x", cap_s=100, min_s=30)
    assert part_timeout(part, 500) == 100
    assert part_timeout(part, 45) == 45
    assert part_timeout(part, 29.9) is None


def test_the_full_cpu_parts_fit_the_default_budget_beside_the_gpu_checks() -> None:
    from bench.device_check import DEFAULT_BUDGET_S, GPU_PART

    assert GPU_PART.cap_s + sum(p.cap_s for p in cpu_parts(quick=False).values()) <= 8 * 60
    assert DEFAULT_BUDGET_S < 8 * 60
    full = cpu_parts(quick=False)
    assert full["rendezvous"].argv[-2:] == ("1000", "4096")


def test_gpu_checks_say_why_they_are_skipped() -> None:
    assert gpu_skip_reason(True, True) == "--cpu-only"
    assert "no CUDA device" in (gpu_skip_reason(False, False) or "")
    assert gpu_skip_reason(False, True) is None


def test_unknown_parts_are_named() -> None:
    assert parse_parts("gpu_stall,rendezvous") == ["gpu_stall", "rendezvous"]
    with pytest.raises(Exception, match="unknown part.*nope"):
        parse_parts("rendezvous,nope")


def test_the_gpu_child_results_survive_a_later_hang() -> None:
    output = ('noise\nDEVICE-CHECK {"check": "gpu_stall", "status": "ok", "figures": {"d2h_pinned_gbps": 50}}\n'
              "Traceback ... (then it hung)\n")
    assert gpu_results(output) == {"gpu_stall": {"status": "ok", "figures": {"d2h_pinned_gbps": 50}}}


def test_a_cpu_only_quick_run_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = [sys.executable, "bench/device_check.py", "--cpu-only", "--quick", "--budget", "150", "--out", str(out),
            "--parts", "gpu_stall,gpu_abort,rendezvous,memtier_restore"]
    done = subprocess.run(argv, cwd=REPO, env=make_env(), capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["version"] == 1 and result["host"]["cpus"] >= 1
    parts = result["parts"]
    assert set(parts) == {"gpu_stall", "gpu_abort", "rendezvous", "memtier_restore"}
    for check in ("gpu_stall", "gpu_abort"):
        assert check in GPU_CHECKS
        assert parts[check]["status"] == "skipped" and "--cpu-only" in parts[check]["reason"]
    assert parts["rendezvous"]["status"] == "ok", parts["rendezvous"]
    assert "first round" in parts["rendezvous"]["output"]  # the benchmark's table came back
    assert parts["memtier_restore"]["status"] == "ok", parts["memtier_restore"]
    assert "GB/s" in parts["memtier_restore"]["output"]
    assert "skipped: gpu_stall: --cpu-only" in done.stdout
