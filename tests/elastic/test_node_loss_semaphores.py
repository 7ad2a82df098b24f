"""A node lost whole leaves no named semaphore behind: the agent, its warm workers and multiprocessing's resource
tracker SIGKILLed (what a node loss, or Slurm's SIGKILL of the step's process group, does), the agent's
``/dev/shm/sem.mp-*`` (torch's worker context under the forkserver) are unlinked by its memory tier keeper."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from elastic.chaos import targets
from elastic.memory_keeper import SEMAPHORES
from tests.harness.procs import SPOTRUN, Launcher, make_env, reap, signal_all, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

_WORKER = """
import os, sys, time
with open(sys.argv[1] + ".tmp", "w") as out:
    out.write(os.environ["SPOTRUN_MEMORY_DIR"])
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)  # a training job: ended by the node's loss
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="named semaphores and the memory tier live in /dev/shm")
def test_a_node_lost_with_its_resource_tracker_leaves_no_semaphore(tmp_path: Path) -> None:
    script, said = tmp_path / "train.py", tmp_path / "memory_dir"
    script.write_text(_WORKER)
    agent = Launcher([*SPOTRUN, "--standalone", "--nproc-per-node", "1", "--warm-workers", str(script), str(said)],
                     tmp_path / "agent.log", env=make_env())
    keeper = None
    try:
        memory_dir = Path(wait_for(lambda: said.exists() and said.read_text(), 60, "the worker to start"))
        listing = memory_dir / SEMAPHORES
        names = wait_for(lambda: listing.exists() and listing.read_text().split(), 30,
                         "the keeper recording the agent's semaphores")
        files = [Path("/dev/shm", name) for name in names]
        assert all(f.exists() for f in files), names
        keeper = targets.keeper_of(agent.pid)
        assert keeper is not None
        tree = [agent.pid, *(pid for pid in targets.descendants(agent.pid) if pid != keeper)]
        assert any(targets.is_resource_tracker(pid) for pid in tree), "no resource tracker to kill"
        signal_all(tree, signal.SIGKILL)  # the agent first: it must not see its workers die
        agent.proc.wait(timeout=30)
        reap(tree[1:], timeout=30)  # orphans: re-parented to this subreaper session
        wait_for(lambda: not any(f.exists() for f in files) and not memory_dir.exists(), 30,
                 "the keeper unlinking the dead agent's semaphores and removing its directory")
        reap([keeper], timeout=30)
        keeper = None
    finally:
        agent.close()
        if keeper is not None:
            signal_all([keeper], signal.SIGKILL)
            reap([keeper], timeout=30)
