"""The worker's peer-loss watcher and its mailbox records (abortable groups, issue 29)."""

from __future__ import annotations

import threading
from pathlib import Path

from elastic.worker.mailbox import Mailbox
from elastic.worker.watcher import PeerLossWatcher


def _box(tmp_path: Path) -> Mailbox:
    (tmp_path / "box").mkdir()
    return Mailbox(str(tmp_path / "box"))


def test_the_watcher_aborts_once_when_the_agent_posts_a_peer_loss(tmp_path: Path) -> None:
    box = _box(tmp_path)
    calls: list[int] = []
    aborted = threading.Event()

    def abort() -> None:
        calls.append(1)
        aborted.set()

    watcher = PeerLossWatcher(box, 3, abort, interval=0.005).start()
    try:
        assert box.watchers() == {3}, "the agent learns that this worker watches"
        assert not aborted.wait(0.1), "nothing posted: no abort"
        box.post_peer_lost(["node-b"])
        assert box.peer_lost_posted()
        assert aborted.wait(10), "the watcher aborts the group"
        assert watcher.fired.is_set()
    finally:
        watcher.stop()
    assert calls == [1]


def test_a_failing_abort_does_not_kill_the_watcher_thread_with_a_traceback(tmp_path: Path) -> None:
    box = _box(tmp_path)
    tried = threading.Event()

    def abort() -> None:
        tried.set()
        raise RuntimeError("no group")

    watcher = PeerLossWatcher(box, 0, abort, interval=0.005).start()
    box.post_peer_lost([])
    assert tried.wait(10)
    watcher.stop()


def test_a_new_group_starts_with_no_peer_loss_and_no_watchers(tmp_path: Path) -> None:
    box = _box(tmp_path)
    box.register_watcher(0)
    box.post_peer_lost(["b"])
    box.clear()
    assert not box.peer_lost_posted() and box.watchers() == set()
