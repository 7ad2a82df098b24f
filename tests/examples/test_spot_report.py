"""examples/spot_report.py: segments, steps lost, the timeline, and the bit-exact comparison of two runs."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from checkpoint import Checkpointer
from tests.harness.scripts import load_script

report = load_script("examples/spot_report.py")


def _line(pid: int, step: int, t: float, world: int = 2) -> dict:
    return {"rank": 0, "world_size": world, "step": step, "pid": pid, "t_wall": t, "loss": 1.0}


PROGRESS = ([_line(1, s, 100.0 + s, world=3) for s in range(1, 9)]       # planned stop at 8
            + [_line(2, s, 110.0 + s) for s in range(9, 48)]              # SIGKILL after 47, checkpoint at 40
            + [_line(3, s, 170.0 + s, world=1) for s in range(41, 60)])


def test_segments_and_steps_lost() -> None:
    segs = report.segments(PROGRESS)
    assert [(s.world_size, s.first_step, s.last_step) for s in segs] == [(3, 1, 8), (2, 9, 47), (1, 41, 59)]
    assert report.steps_lost(segs) == [0, 7]


def test_timeline_is_in_time_order_with_names() -> None:
    events = [{"event": "notice_received", "node": "vm:77", "t_wall": 108.5, "source": "sigterm"},
              {"event": "workers_started", "node": "vm:78", "t_wall": 109.0}]
    lines = report.timeline_lines(events, report.segments(PROGRESS), {"77": "C"})
    assert lines[0].startswith("+    0.0s  training   steps 1..8 at world size 3")
    assert "C          notice_received          source=sigterm" in lines[1]
    assert "node-2" in lines[2] and lines[2].startswith("+    8.0s")


def _save(root: Path, weight: float) -> None:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(weight)
        model.bias.zero_()
    with Checkpointer(str(root)) as ckpt:
        ckpt.save(5, {"model": model})
        ckpt.wait()


def test_compare_passes_only_for_identical_tensors(tmp_path: Path, capsys) -> None:
    _save(tmp_path / "a", 0.5)
    _save(tmp_path / "b", 0.5)
    _save(tmp_path / "c", 0.5 + 2**-20)
    assert report.compare(tmp_path / "a", tmp_path / "b") == []
    assert report.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "PASS" in capsys.readouterr().out
    problems = report.compare(tmp_path / "a", tmp_path / "c")
    assert len(problems) == 1 and problems[0].startswith("model.weight: max abs difference")
    assert report.main(["compare", str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    assert "FAIL" in capsys.readouterr().out
