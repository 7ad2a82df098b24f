"""``elastic.inplace.run`` without an agent: one entry outside spotrun, what it releases and in which order, the
capability mark, and the fallbacks it reports to the agent (``fallback-N.json``). End to end (real agents, real
etcd, gloo): tests/elastic/test_abortable.py (a lost peer) and test_reform_in_place.py (a peer's leave)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest

from elastic import inplace
from elastic.api import ENV_NOTICE_DIR, ENV_REFORM_IN_PLACE, InPlaceFallback
from elastic.worker.mailbox import Mailbox, WorkerNotice

pytestmark = pytest.mark.timeout(60)


class Closable:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def close(self) -> None:
        self.log.append(self.name)


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Mailbox:
    (tmp_path / "mailbox").mkdir()
    monkeypatch.setenv(ENV_NOTICE_DIR, str(tmp_path / "mailbox"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv(ENV_REFORM_IN_PLACE, raising=False)
    return Mailbox(str(tmp_path / "mailbox"))


def test_outside_spotrun_the_function_runs_once_and_its_objects_are_released_newest_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_NOTICE_DIR, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    log: list[str] = []
    entries: list[inplace.Generation] = []

    def train(gen: inplace.Generation, scale: int, *, offset: int) -> int:
        entries.append(gen)
        gen.track(Closable("checkpointer", log))
        gen.track(Closable("memory", log))
        gen.track(object())  # e.g. a DDP module: dropped
        gen.track("x", release=lambda _: log.append("custom"))
        return scale * 10 + offset

    assert inplace.run(train, 4, offset=2) == 42
    assert log == ["custom", "memory", "checkpointer"]
    (gen,) = entries
    assert (gen.iteration, gen.reformed, gen.in_place, gen.after_loss) == (0, False, False, False)


def test_under_spotrun_the_worker_says_it_can_re_form_in_place(box: Mailbox) -> None:
    seen: list[bool] = []
    inplace.run(lambda gen: seen.append(gen.in_place))
    assert seen == [True] and box.in_place_capable() == {0}


def test_spotrun_reform_in_place_0_turns_it_off(box: Mailbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_REFORM_IN_PLACE, "0")
    seen: list[bool] = []
    inplace.run(lambda gen: seen.append(gen.in_place))
    assert seen == [False] and box.in_place_capable() == set(), "no mark: the agent restarts the workers"


def test_the_workers_own_error_is_raised_after_the_release(box: Mailbox) -> None:
    log: list[str] = []

    def train(gen: inplace.Generation) -> None:
        gen.track(Closable("checkpointer", log))
        raise ValueError("a bug in the training step")

    with pytest.raises(ValueError, match="a bug"):
        inplace.run(train)
    assert log == ["checkpointer"]
    assert box.fallbacks() == {}, "its own failure: a restart as a process, no in-place fallback to report"


def test_a_failed_final_release_fails_the_run_as_without_the_wrapper(box: Mailbox) -> None:
    def fail(_: object) -> None:
        raise OSError("the final save did not commit")

    with pytest.raises(OSError, match="did not commit"):
        inplace.run(lambda gen: gen.track(object(), release=fail))


def test_a_planned_stop_without_a_new_group_in_time_reports_a_timeout_and_exits(box: Mailbox) -> None:
    """A peer's leave: the worker acknowledged its agreed step and waits; no assignment comes within
    ``wait_timeout``: it reports ``timeout`` to the agent and returns (exit 0, as the plain script would)."""
    box.post(WorkerNotice("peer_preempt", None, "node b"))

    def train(gen: inplace.Generation) -> str:
        box.acknowledge(0, 12)  # what Preemption.save_and_stop does at the agreed step
        return "stopped"

    config = inplace.InPlaceConfig(wait_timeout=timedelta(seconds=0.2))
    assert inplace.run(train, config=config) == "stopped"
    assert box.waiting() == {0}
    ((why, detail),) = box.fallbacks().values()
    assert why == InPlaceFallback.TIMEOUT.value and "after the planned stop" in detail, detail


def test_this_nodes_own_notice_is_no_fallback(box: Mailbox) -> None:
    box.post(WorkerNotice("preempt", None, "this node"))

    def train(gen: inplace.Generation) -> str:
        box.acknowledge(0, 12)
        return "left"

    assert inplace.run(train) == "left"
    assert box.waiting() == set() and box.fallbacks() == {}, "the leaving node's workers exit, as always"


def test_a_broken_collective_without_a_peer_loss_is_the_workers_own_failure(box: Mailbox) -> None:
    config = inplace.InPlaceConfig(loss_notice_wait=timedelta(seconds=0.1))

    def train(gen: inplace.Generation) -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    with pytest.raises(RuntimeError, match="Connection closed"):
        inplace.run(train, config=config)
    assert box.waiting() == set() and box.fallbacks() == {}


def test_after_a_peer_loss_without_a_new_group_in_time_it_reports_a_timeout(box: Mailbox) -> None:
    config = inplace.InPlaceConfig(wait_timeout=timedelta(seconds=0.2))
    poster = threading.Timer(0.05, box.post_peer_lost, args=(["node-b"],))

    def train(gen: inplace.Generation) -> None:
        poster.start()
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    with pytest.raises(inplace.InPlaceFallbackError) as caught:
        inplace.run(train, config=config)
    assert caught.value.why is InPlaceFallback.TIMEOUT
    assert box.fallbacks()[0][0] == "timeout"


@pytest.mark.parametrize("bad", [{"wait_timeout": timedelta(0)}, {"loss_notice_wait": 3.0},
                                 {"pg_timeout": timedelta(seconds=-1)}, {"backend": ""}])
def test_a_bad_config_says_what_is_wrong(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        inplace.InPlaceConfig(**bad)


def test_a_configuration_that_cannot_go_on_in_place_runs_once_and_says_nothing(box: Mailbox) -> None:
    seen: list[bool] = []
    inplace.run(lambda gen: seen.append(gen.in_place), config=inplace.InPlaceConfig(enabled=False))
    assert seen == [False] and box.in_place_capable() == set()


NEW = dict(fresh=True, aware=False, after_loss=False, step=None)


@pytest.mark.parametrize(("votes", "restore", "why"), [
    ([NEW, NEW], True, None),  # a start: every rank restores
    ([dict(fresh=False, aware=False, after_loss=False, step=7)] * 2, False, None),  # a peer's leave
    ([dict(fresh=False, aware=False, after_loss=True, step=7)] * 2, False, None),  # a loss, same step
    ([dict(fresh=False, aware=True, after_loss=False, step=7), NEW], True, None),  # a join
    ([dict(fresh=False, aware=False, after_loss=False, step=7), NEW], False, InPlaceFallback.NEW_NODE),
    ([dict(fresh=False, aware=True, after_loss=True, step=7), dict(fresh=False, aware=True, after_loss=True, step=8)],
     True, None),  # steps differ: all restore one step
    ([dict(fresh=False, aware=False, after_loss=True, step=7), dict(fresh=False, aware=True, after_loss=True, step=8)],
     False, InPlaceFallback.STEPS_DIFFER),
    ([dict(fresh=False, aware=False, after_loss=True, step=None)], False, InPlaceFallback.STEP_UNKNOWN),
    ([dict(fresh=False, aware=True, after_loss=True, step=None)], True, None),
])
def test_every_rank_decides_the_same_entry_from_the_votes_of_all(votes: list[dict], restore: bool,
                                                                 why: InPlaceFallback | None) -> None:
    """What the all-reduce (MAX) of the ranks' votes decides: restore, go on from memory, or all fall back."""
    from elastic.worker.inplace import EntryVote, decide_entry

    lists = [EntryVote.of(**vote).to_list() for vote in votes]
    together = EntryVote.from_list([max(column) for column in zip(*lists, strict=True)])
    decision = decide_entry(together)
    assert decision.restore is restore
    assert (decision.fallback[0] if decision.fallback else None) is why


def test_asking_whether_to_restore_makes_the_worker_joinable(box: Mailbox) -> None:
    answers: list[bool] = []
    inplace.run(lambda gen: None)
    assert box.joinable() == set(), "a function that never asks cannot take part in a joiner's restore"
    inplace.run(lambda gen: answers.append(gen.needs_restore))
    assert answers == [True] and box.joinable() == {0}, "the first entry restores; the worker is now joinable"


def test_a_broken_collective_while_a_node_joins_restarts_a_worker_that_cannot_restore(box: Mailbox) -> None:
    """A peer's worker failed and its agent restarted it (a join for this node): a worker whose function never
    asks ``needs_restore`` exits at once with its error (a restart takes part in the restore), not after the
    loss-notice wait."""
    box.post(WorkerNotice("resize", None, "a node is waiting to join"))
    config = inplace.InPlaceConfig(loss_notice_wait=timedelta(seconds=30))

    def train(gen: inplace.Generation) -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    with pytest.raises(RuntimeError, match="Connection closed"):
        inplace.run(train, config=config)
    assert box.waiting() == set()


def test_a_broken_collective_while_a_node_joins_waits_in_place_when_the_worker_can_restore(box: Mailbox) -> None:
    box.post(WorkerNotice("resize", None, "a node is waiting to join"))
    config = inplace.InPlaceConfig(loss_notice_wait=timedelta(seconds=30), wait_timeout=timedelta(seconds=0.2))

    def train(gen: inplace.Generation) -> None:
        assert gen.needs_restore
        gen.completed(5)
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    with pytest.raises(inplace.InPlaceFallbackError) as caught:
        inplace.run(train, config=config)
    assert caught.value.why is InPlaceFallback.TIMEOUT, "it waited for its new group (none came in this test)"
    assert box.waiting() == {0}


def test_the_entry_vote_runs_on_the_default_group(tmp_path: Path) -> None:
    """One all-reduce (MAX) of the vote on a real gloo group, its tensor on the CPU."""
    import torch.distributed as dist

    from elastic.worker.inplace import EntryVote, agree_on_entry, collective_device

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert collective_device().type == "cpu"
        vote = EntryVote.of(fresh=False, aware=True, after_loss=True, step=9)
        assert agree_on_entry(vote) == vote
    finally:
        dist.destroy_process_group()
