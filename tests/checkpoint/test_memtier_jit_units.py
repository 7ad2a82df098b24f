"""Just-in-time snapshots (``checkpoint.memory.jit``, ``LocalShmTier.snapshot_on_failure``) and restore records
(``checkpoint.memory.records``) in one process: which failures are snapshotted, which snapshots they keep, the
signals held back, and the agent's reading of hostile record files.

The multi-node path (a node SIGKILLed, the survivor snapshots and restores) is tests/elastic/test_memtier_jit.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpoint._sys.procutil import exited, process_gone, process_identity
from checkpoint.memory.api import RestoreReport, RestoreSource
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.jit import DeferredSignals, is_collective_failure, wait_for_names
from checkpoint.memory.layout import parse_snapshot_name
from checkpoint.memory.records import (
    MAX_BYTES,
    RestoreRecord,
    collect_restore_records,
    parse_record,
    record_name,
    snapshots_in,
    summarize,
    write_restore_record,
)
from checkpoint.memory.resume import restore
from checkpoint.memory.shm import LocalShmTier
from elastic.api import RecoveryEvent
from elastic.metrics import AgentMetrics, RecoveryClock, observe
from tests.checkpoint.test_memtier import SHM, _assert_equal, _snapshots, _state, _tensors, _train


@pytest.fixture
def shm_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="spotrun-memtier-test-", dir=SHM)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

GLOO_ERROR = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")


def _steps(path: str) -> list[int]:
    return [parse_snapshot_name(n)[0].step for n in _snapshots(path)]  # type: ignore[index]


def _restored(path: str, seed: int = 1) -> tuple[RestoreReport | None, dict]:
    fresh = _state(seed)
    tier = LocalShmTier(path)
    try:
        return tier.restore(fresh, not_older_than=None), fresh
    finally:
        tier.close()


def _reference(steps: int) -> dict:
    ref = _state(0)
    for step in range(1, steps + 1):
        _train(ref, step)
    return ref


def test_failed_collectives_are_recognised_through_their_chain() -> None:
    assert is_collective_failure(GLOO_ERROR)
    try:
        try:
            raise GLOO_ERROR
        except RuntimeError as exc:
            raise ValueError("the planned-stop vote failed") from exc
    except ValueError as wrapped:
        assert is_collective_failure(wrapped)
    assert not is_collective_failure(ValueError("loss is nan"))
    assert not is_collective_failure(RuntimeError("CUDA out of memory"))
    assert not is_collective_failure(KeyboardInterrupt())
    assert not is_collective_failure(None)


def test_jit_snapshot_keeps_the_complete_and_the_newest_step_and_restores_exactly(shm_dir: str) -> None:
    state = _state(0)
    tier = LocalShmTier(shm_dir, MemoryTierConfig(every=2, jit_peer_wait=0.5))
    try:
        for step in range(1, 8):
            _train(state, step)
            tier.snapshot(step, state)
        tier.wait()
        assert _steps(shm_dir) == [4, 6]
        # step 8's collective breaks: the state is still that of step 7
        assert tier.snapshot_on_failure(7, state, GLOO_ERROR) is True
        assert _steps(shm_dir) == [4, 6, 7]  # a third slot: neither the complete step nor the newest is lost
        assert tier.snapshot_on_failure(7, state, GLOO_ERROR) is True  # already held: nothing written
        assert _steps(shm_dir) == [4, 6, 7]
    finally:
        tier.close()
    report, fresh = _restored(shm_dir)
    assert report is not None and report.step == 7 and report.source is RestoreSource.MEMORY_LOCAL
    assert fresh["meta"] == {"step": 7}
    _assert_equal(_tensors(fresh), _tensors(_reference(7)))


def test_other_failures_and_unplanned_tiers_write_nothing(shm_dir: str) -> None:
    state = _state(0)
    tier = LocalShmTier(shm_dir, MemoryTierConfig(every=5))
    try:
        assert tier.snapshot_on_failure(0, state, GLOO_ERROR) is False  # never planned: no collective to plan with
        _train(state, 1)
        assert tier.snapshot(1, state) is False  # the first call plans, at a step it does not snapshot
        assert _snapshots(shm_dir) == []
        assert tier.snapshot_on_failure(1, state, ValueError("loss is nan")) is False  # maybe half-updated
        assert _snapshots(shm_dir) == []
        state["extra"] = {"new": 1}
        state["model2"] = _state(3)["model"]
        assert tier.snapshot_on_failure(1, state, GLOO_ERROR) is False  # items changed since the plan
        del state["extra"], state["model2"]
        assert tier.snapshot_on_failure(1, state, GLOO_ERROR) is True
        assert _steps(shm_dir) == [1]
    finally:
        tier.close()
    report, fresh = _restored(shm_dir)
    assert report is not None and report.step == 1
    _assert_equal(_tensors(fresh), _tensors(_reference(1)))


def test_signals_are_held_back_during_the_snapshot_and_delivered_after() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with DeferredSignals():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == []  # the Python handler ran, but it only recorded
        assert seen == [signal.SIGTERM]  # delivered once, to the handler that was installed before
        assert signal.getsignal(signal.SIGTERM) is not None and signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_deferring_outside_the_main_thread_changes_nothing() -> None:
    before = signal.getsignal(signal.SIGTERM)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with DeferredSignals():
                assert signal.getsignal(signal.SIGTERM) is before
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not errors


def test_waiting_for_the_node_files_is_bounded(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"")
    assert wait_for_names(str(tmp_path), ["a"], 5.0) == []
    assert wait_for_names(str(tmp_path), ["a", "b"], 0.05) == ["b"]
    assert wait_for_names(str(tmp_path / "gone"), ["a"], 0.05) == ["a"]


def test_a_process_is_gone_once_it_exited_even_unreaped_or_its_pid_reused() -> None:
    me = process_identity(os.getpid())
    assert me is not None and not process_gone(me) and not exited(os.getpid())
    pid, start, namespace = me.split(":")
    assert process_gone(f"{pid}:1:{namespace}")  # same PID, another start time: a reused PID
    assert not process_gone(f"{pid}:1:1")  # taken in another PID namespace (another container): unsure
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = process_identity(child.pid)
        assert identity is not None and not process_gone(identity)
        child.kill()
        deadline = time.monotonic() + 10
        while not process_gone(identity) and time.monotonic() < deadline:  # a zombie until reaped: gone already
            time.sleep(0.01)
        assert process_gone(identity) and exited(child.pid)
    finally:
        child.kill()
        child.wait()
    assert process_gone(identity) and exited(child.pid)  # reaped
    assert not process_gone(None)  # /proc could not tell: never "gone"
    for damaged in (12, ["1", "2"], "", "x:1:1", "-1:5:1", "0:5:1", "12", "1::", "\u00b2:1:1", f"{pid}:{start}"):
        assert not process_gone(damaged), damaged


def test_waiting_for_the_node_files_ends_when_the_missing_writers_are_dead(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"")
    started = time.monotonic()
    assert wait_for_names(str(tmp_path), ["a", "b"], 60.0, gone=lambda name: name == "b") == ["b"]
    assert time.monotonic() - started < 30  # ended by the dead writer, not by the 60 s bound
    assert wait_for_names(str(tmp_path), ["a", "b"], 0.05, gone=lambda name: False) == ["b"]  # alive: waits it out


# --------------------------------------------------------------------------- restore records
def test_restore_records_round_trip_and_are_deleted_once_read(tmp_path: Path) -> None:
    report = RestoreReport(RestoreSource.MEMORY_LOCAL, 12, 4096, 0.25)
    write_restore_record(str(tmp_path), 1, 2, report)
    write_restore_record(str(tmp_path), 0, 2, RestoreReport(RestoreSource.MEMORY_LOCAL, 12, 1024, 0.5))
    records = collect_restore_records(str(tmp_path))
    assert records == [RestoreRecord(0, 2, RestoreSource.MEMORY_LOCAL, 12, 1024, 0.5),
                       RestoreRecord(1, 2, RestoreSource.MEMORY_LOCAL, 12, 4096, 0.25)]  # fmt: skip
    assert os.listdir(tmp_path) == []
    assert summarize(records) == {"restore_source": "memory_local", "restore_step": 12, "restore_bytes": 5120,
                                  "restore_seconds": 0.5, "ranks": [0, 1]}  # fmt: skip
    mixed = summarize([records[0], RestoreRecord(1, 2, RestoreSource.DURABLE, 10, 1, 1.0)])
    assert mixed["restore_source"] == "mixed" and mixed["restore_sources"] == {"0": "memory_local", "1": "durable"}
    assert "restore_fallback" not in mixed
    # A durable restore with the tier on says why memory was not used, and the event carries it.
    why = "saved rank(s) [0] have neither their snapshot nor a buddy copy"
    write_restore_record(str(tmp_path), 0, 1, RestoreReport(RestoreSource.DURABLE, 10, 1, 1.0, fallback=why))
    (durable,) = collect_restore_records(str(tmp_path))
    assert durable.fallback == why and summarize([durable])["restore_fallback"] == why


@pytest.mark.parametrize(
    "body, problem",
    [
        (b"{" * 5000, "bytes"),
        (b"not json", "not JSON"),
        (b"[1]", "not a JSON object"),
        (b'{"rank": 0, "world_size": 1, "restore_source": "tape", "restore_step": 1, "restore_bytes": 1, '
         b'"restore_seconds": 1}', "unknown"),
        (b'{"rank": 3, "world_size": 2, "restore_source": "durable", "restore_step": 1, "restore_bytes": 1, '
         b'"restore_seconds": 1}', "rank 3 of a world of 2"),
        (b'{"rank": 0, "world_size": 1, "restore_source": "durable", "restore_step": -1, "restore_bytes": 1, '
         b'"restore_seconds": 1}', "restore_step"),
        (b'{"rank": 0, "world_size": 1, "restore_source": "durable", "restore_step": 1, "restore_bytes": 1, '
         b'"restore_seconds": true}', "restore_seconds"),
        (b'{"rank": 0, "world_size": 1, "restore_source": "durable", "restore_step": 1, "restore_bytes": 1, '
         b'"restore_seconds": 1, "restore_fallback": 7}', "restore_fallback"),
    ],
)
def test_hostile_restore_records_are_rejected_by_name(body: bytes, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_record(body)


def test_the_agent_skips_and_deletes_bad_or_linked_records(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / record_name(0)).write_bytes(b"x" * (MAX_BYTES + 10))
    secret = tmp_path / "secret"
    secret.write_text("{}")
    os.symlink(secret, tmp_path / record_name(1))
    (tmp_path / "unrelated.json").write_text("{}")
    assert collect_restore_records(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == ["secret", "unrelated.json"]
    assert "ignoring the restore record" in caplog.text
    assert collect_restore_records(str(tmp_path / "missing")) == []


def test_a_restore_under_the_agent_leaves_its_record(shm_dir: str) -> None:
    state = _state(0)
    tier = LocalShmTier(shm_dir)
    try:
        _train(state, 1)
        tier.snapshot(1, state)
        tier.wait()
    finally:
        tier.close()
    assert snapshots_in(shm_dir) and not snapshots_in(shm_dir + "-missing")
    fresh = _state(1)
    tier = LocalShmTier(shm_dir)
    try:
        report = restore(None, fresh, memory=tier)
    finally:
        tier.close()
    assert report is not None
    (record,) = collect_restore_records(shm_dir)
    assert (record.rank, record.world_size, record.source, record.step) == (0, 1, RestoreSource.MEMORY_LOCAL, 1)


def test_restores_are_counted_by_source_in_the_metrics() -> None:
    metrics = AgentMetrics()
    fields = {"restore_source": "memory_local", "restore_seconds": 0.2, "restore_step": 3}
    observe(metrics, RecoveryClock(), RecoveryEvent.RESTORE_COMPLETED, fields, now=1.0)
    observe(metrics, RecoveryClock(), RecoveryEvent.RESTORE_COMPLETED, {**fields, "restore_source": "durable"}, now=2.0)
    value = metrics.registry.get_sample_value
    assert value("spotrun_restores_total", {"source": "memory_local"}) == 1.0
    assert value("spotrun_restores_total", {"source": "durable"}) == 1.0
    assert value("spotrun_restore_seconds_count", {"source": "memory_local"}) == 1.0


# --------------------------------------------------------------------------- every="auto"
def test_auto_interval_is_the_smallest_that_meets_the_overhead_target() -> None:
    from checkpoint.memory.layout import choose_every

    assert choose_every(1.0, 0.01, 0.02, 100) == 1  # 1 % of a step: every step
    assert choose_every(1.0, 0.05, 0.02, 100) == 3  # 0.05 / 3 steps = 1.7 % <= 2 %
    assert choose_every(0.1, 1.0, 0.02, 100) == 100  # capped
    assert choose_every(0.0, 0.01, 0.02, 100) == 100  # no step time measured: as rarely as allowed
    assert choose_every(0.5, 0.0, 0.02, 100) == 1


def test_auto_interval_grows_when_staging_dominates_and_stays_the_same_on_every_call(shm_dir: str) -> None:
    state = _state(0)
    tier = LocalShmTier(shm_dir, MemoryTierConfig(every="auto", overhead_target=0.01, max_every=7))
    acted = []
    try:
        for step in range(1, 60):  # steps of microseconds: staging costs far more than 1 % of them
            if tier.snapshot(step, state):
                acted.append(step)
        tier.wait()
    finally:
        tier.close()
    assert acted[:2] == [1, 2]  # measures first
    assert tier.interval == 7 and all(s % 7 == 0 for s in acted[3:])  # then the cap, on the steps divisible by it


def test_config_rejects_bad_auto_settings() -> None:
    from checkpoint.api import CheckpointConfigError

    for bad in ({"every": "sometimes"}, {"overhead_target": 0}, {"overhead_target": 1.5}, {"max_every": 0},
                {"jit_peer_wait": -1}):
        with pytest.raises(CheckpointConfigError):
            MemoryTierConfig(**bad)  # type: ignore[arg-type]


def test_jit_leaves_a_stuck_snapshot_in_flight_alone(shm_dir: str) -> None:
    """A periodic snapshot whose background thread is stuck (a buddy exchange with a dead peer) is waited for
    only ``jit_peer_wait``; the just-in-time snapshot then writes another slot, never the one in use."""
    from concurrent.futures import Future

    state = _state(0)
    tier = LocalShmTier(shm_dir, MemoryTierConfig(every=1, jit_peer_wait=0.2))
    try:
        for step in range(1, 4):
            _train(state, step)
            tier.snapshot(step, state)
        tier.wait()
        stuck: Future[int] = Future()  # never completes
        tier.inflight.future, tier.inflight.slot = stuck, tier.slots.items[0]
        _train(state, 4)
        assert tier.snapshot_on_failure(4, state, GLOO_ERROR) is True
        assert tier.slots.items[0] is not None and tier.slots.items[0].step != 4  # the stuck slot was not touched
        assert 4 in _steps(shm_dir)
        stuck.set_result(-1)
    finally:
        tier.close()
    report, fresh = _restored(shm_dir)
    assert report is not None and report.step == 4
    _assert_equal(_tensors(fresh), _tensors(_reference(4)))


SLOW_RANK_SECONDS = 0.5


def _snapshot_beside_a_slow_rank(rank: int, world: int, directory: str) -> list[float]:
    import time

    state = _state(0)
    tier = LocalShmTier(directory, MemoryTierConfig(every="auto"))
    staged: list[float] = []
    try:
        for step in range(1, 5):
            _train(state, step, rank)
            if rank == 1:
                time.sleep(SLOW_RANK_SECONDS)  # a slower rank: rank 0 waits for it in the snapshot vote
            tier.snapshot(step, state)
            staged.append(tier.last_stage_seconds)
        tier.wait()
        return staged
    finally:
        tier.close()


def test_auto_does_not_count_the_wait_for_a_slower_rank_as_snapshot_cost(shm_dir: str, tmp_path: Path) -> None:
    """The vote's wait for a slower rank is time the next gradient all-reduce would wait anyway: counted as
    snapshot cost it made ``every="auto"`` choose long intervals on a loaded host."""
    from tests.harness.dist import run_workers

    fast, _ = run_workers(_snapshot_beside_a_slow_rank, 2, (shm_dir,), tmpdir=str(tmp_path), timeout=120)
    assert max(fast[1:]) < SLOW_RANK_SECONDS / 2, fast  # the first vote may include the group's warm-up
