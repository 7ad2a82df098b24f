"""The worker-side package: it imports nothing of the agent, the old import paths name the same objects, and
the mailbox protocol reads only what its types say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.worker.mailbox import Acknowledgement, Mailbox, WorkerNotice
from tests.harness.procs import REPO

pytestmark = pytest.mark.timeout(60)

WORKER_MODULES = ["elastic.worker.mailbox", "elastic.worker.preemption", "elastic.worker.heartbeat",
                  "elastic.worker.data", "elastic.worker.deterministic", "elastic.worker.runfiles",
                  "elastic.worker.reform", "elastic.worker.watcher"]


def test_the_worker_package_imports_nothing_of_the_agent() -> None:
    """A training process pays for what it uses: no agent, launcher, rendezvous or torch elastic agent code."""
    code = ("import sys, json\n" + "".join(f"import {m}\n" for m in WORKER_MODULES)
            + "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=50,
                         check=False)
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout))
    assert set(WORKER_MODULES) <= loaded
    ours = sorted(m for m in loaded if m.split(".")[0] in ("elastic", "checkpoint"))
    # elastic.options: the stdlib-only option table elastic.api reads its SPOTRUN_* names from
    assert ours == sorted(["elastic", "elastic.api", "elastic.options", "elastic.worker", *WORKER_MODULES]), ours
    assert not [m for m in loaded if m.startswith("torch.distributed.elastic")], "torch's agent came along"


@pytest.mark.parametrize(
    ("old", "new", "names"),
    [
        ("elastic.preemption", "elastic.worker.preemption", ["Preemption", "SaveDecision", "decide_planned_save",
                                                              "DEFAULT_SAVE_MARGIN", "SAVE_SLACK_SECONDS"]),
        ("elastic.preemption", "elastic.worker.mailbox", ["Mailbox", "WorkerNotice", "find_mailbox",
                                                           "remove_orphaned_mailboxes", "LINK_KIND"]),
        ("elastic.progress", "elastic.worker.heartbeat", ["heartbeat", "install", "progress_path", "dump_path",
                                                          "MAGIC", "SIZE", "DUMP_SIGNAL"]),
        ("elastic.progress", "elastic.worker.runfiles", ["run_scoped_path", "run_scoped_prefix"]),
        ("elastic.data", "elastic.worker.data", ["ElasticBatches", "BatchConfig", "DataCursor",
                                                 "ElasticBatchSampler", "StepPlan", "ElasticDataError",
                                                 "rank_bounds"]),
        ("elastic.deterministic", "elastic.worker.deterministic", ["ShardGradReducer", "dyadic_blocks",
                                                                   "tree_sum"]),
    ],
)
def test_the_old_import_paths_name_the_same_objects(old: str, new: str, names: list[str]) -> None:
    import importlib

    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_module, name) is getattr(new_module, name), f"{old}.{name}"


def test_every_public_name_of_the_moved_modules_is_still_at_its_old_path() -> None:
    import elastic.data
    import elastic.deterministic
    import elastic.worker.data
    import elastic.worker.deterministic

    for old, new in ((elastic.data, elastic.worker.data), (elastic.deterministic, elastic.worker.deterministic)):
        assert [n for n in new.__all__ if getattr(old, n, None) is not getattr(new, n)] == [], old.__name__


def test_a_notice_with_a_malformed_deadline_reads_as_one_without_a_bound(tmp_path: Path) -> None:
    box = Mailbox(str(tmp_path))
    (tmp_path / "notice.json").write_text(json.dumps({"reason": "preempt", "deadline": "soon", "source": "x"}))
    assert box.read_notice() == WorkerNotice("preempt", None, "x", save_by=None), "still a notice, typed"


def test_acknowledgements_are_typed_records(tmp_path: Path) -> None:
    box = Mailbox(str(tmp_path))
    box.acknowledge(0, 8)
    box.acknowledge(1, 8, saved=False, why="no time")
    (tmp_path / "ack-2.json").write_text(json.dumps({"step": True, "time": 1.0}))  # not a step: malformed
    acks = box.acknowledgements()
    assert set(acks) == {0, 1}
    assert acks[0] == Acknowledgement(8, acks[0].time, saved=True, why="") and isinstance(acks[0].time, float)
    assert acks[1].saved is False and acks[1].why == "no time"


def test_fallback_records_carry_only_a_known_reason_and_a_bounded_detail(tmp_path: Path) -> None:
    box = Mailbox(str(tmp_path))
    box.report_fallback(0, "timeout", "x" * 5000)
    (tmp_path / "fallback-1.json").write_text(json.dumps({"why": "rm -rf /\n<b>", "detail": "hostile"}))
    (tmp_path / "fallback-2.json").write_text(json.dumps({"why": ["timeout"]}))
    (tmp_path / "fallback-3.json").write_text("{not json")
    reported = box.fallbacks()
    assert set(reported) == {0}
    assert reported[0][0] == "timeout" and len(reported[0][1]) == 2000
