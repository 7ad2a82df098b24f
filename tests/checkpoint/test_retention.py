"""Retention is a pure function of (committed, uncommitted, config, in-flight)."""

from __future__ import annotations

import random

import pytest

from checkpoint.retention import steps_to_delete

pytestmark = pytest.mark.timeout(30)


def test_keep_last() -> None:
    assert steps_to_delete([1, 2, 3, 4, 5], [], keep_last=2) == [1, 2, 3]
    assert steps_to_delete([5, 1, 3], [], keep_last=3) == []
    assert steps_to_delete([], [1, 2], keep_last=1) == []  # nothing committed: nothing is debris yet


def test_keep_every() -> None:
    committed = list(range(100, 1100, 100))
    assert steps_to_delete(committed, [], keep_last=2, keep_every=500) == [100, 200, 300, 400, 600, 700, 800]


def test_debris_and_in_flight() -> None:
    assert steps_to_delete([10, 20], [5, 15, 25], keep_last=5) == [5, 15]
    assert steps_to_delete([10, 20], [5, 15, 25], keep_last=5, in_flight=15) == [5]
    assert steps_to_delete([10, 20, 30], [], keep_last=1, in_flight=20) == [10]


def test_invalid_keep_last() -> None:
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        steps_to_delete([1], [], keep_last=0)


def test_invariants_random() -> None:
    rng = random.Random(1234)
    for _ in range(500):
        committed = rng.sample(range(1, 60), rng.randint(0, 12))
        uncommitted = [s for s in rng.sample(range(1, 60), rng.randint(0, 6)) if s not in committed]
        keep_last = rng.randint(1, 4)
        keep_every = rng.choice([None, 5, 10])
        in_flight = rng.choice([None, *uncommitted, *committed]) if committed or uncommitted else None
        doomed = set(steps_to_delete(committed, uncommitted, keep_last=keep_last, keep_every=keep_every, in_flight=in_flight))
        assert doomed <= set(committed) | set(uncommitted)
        assert in_flight not in doomed
        if committed:
            newest = max(committed)
            assert newest not in doomed
            kept = sorted(set(committed) - doomed)
            assert kept[-min(keep_last, len(committed)):] == sorted(committed)[-min(keep_last, len(committed)):]
            assert all(s > newest for s in set(uncommitted) - doomed - {in_flight})
        if keep_every:
            assert not any(s % keep_every == 0 for s in doomed & set(committed))


def test_apply_retention_deletes_what_steps_to_delete_chooses(tmp_path) -> None:
    from checkpoint.api import COMMIT_FILE, step_dir
    from checkpoint.discover import list_steps
    from checkpoint.retention import apply_retention
    from checkpoint.storage import Storage

    storage = Storage(str(tmp_path))
    for step in (1, 2, 3, 4):
        storage.write_bytes(f"{step_dir(step)}/{COMMIT_FILE}", b"{}")
    storage.write_bytes(f"{step_dir(2)}/x", b"half-written debris")
    assert apply_retention(storage, 4, keep_last=2, keep_every=None) == [1, 2]
    assert list_steps(storage).committed == [3, 4] and not storage.exists(step_dir(2))
