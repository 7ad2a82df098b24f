"""The root cause first in the failure summary, whatever order the agent saw the deaths in."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastic.agent_procs import failure_order


def _raised(tmp_path: Path, local_rank: int, at: int) -> ProcessFailure:
    error_file = tmp_path / f"error-{local_rank}.json"
    error_file.write_text(json.dumps({"message": {"message": "RuntimeError: peer gone",
                                                  "extraInfo": {"timestamp": str(at)}}}))
    return ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=1, error_file=str(error_file))


def _killed(local_rank: int) -> ProcessFailure:
    return ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=-signal.SIGKILL,
                          error_file=f"/nonexistent/error-{local_rank}.json")


def _order(failures: list[ProcessFailure], died_at: dict[int, float]) -> list[int]:
    return [f.local_rank for f in sorted(failures, key=lambda f: failure_order(f, died_at))]


def test_a_tie_puts_the_signalled_worker_before_the_one_whose_collective_broke(tmp_path: Path) -> None:
    raised, killed = _raised(tmp_path, 0, int(time.time()) - 5), _killed(1)
    assert killed.timestamp > raised.timestamp  # torch stamps a failure without an error file "now"
    assert _order([raised, killed], {0: 10.0, 1: 10.0}) == [1, 0]
    assert _order([raised, killed], {}) == [1, 0]


def test_known_death_times_decide_over_the_kind_of_death(tmp_path: Path) -> None:
    raised, killed = _raised(tmp_path, 0, int(time.time())), _killed(1)
    assert _order([raised, killed], {0: 10.0, 1: 10.5}) == [0, 1]
    assert _order([raised, killed], {0: 10.0}) == [0, 1]


def test_two_raised_workers_in_a_tie_go_by_their_error_files(tmp_path: Path) -> None:
    early, late = _raised(tmp_path, 1, 1000), _raised(tmp_path, 0, 2000)
    assert _order([late, early], {0: 3.0, 1: 3.0}) == [1, 0]
