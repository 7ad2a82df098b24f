"""The warm forkserver never initialises CUDA (a process forked from one that did cannot use CUDA), and the
agent falls back to plain workers, saying why, if a preloaded module ever does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from elastic.workers import cuda_fork_problem, inherited_cuda_context
from tests.harness.procs import REPO, make_env

PROBE = """
import json, sys
from elastic import warm
from elastic.workers import DEFAULT_PRELOAD, forkserver_cuda_initialized, start_warm_forkserver
start_warm_forkserver(DEFAULT_PRELOAD)
print(json.dumps({"cuda": forkserver_cuda_initialized(), "failure": warm._forkserver_failure}))
"""


def test_the_preloaded_forkserver_has_not_initialised_cuda() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=make_env(), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # False, not None: the forkserver's first child answered after torch (and every preload) was imported.
    assert report == {"cuda": False, "failure": None}, report


def test_a_forkserver_with_cuda_is_refused_with_the_reason() -> None:
    assert cuda_fork_problem(None) is None and cuda_fork_problem(False) is None
    why = cuda_fork_problem(True)
    assert why is not None and "initialised CUDA" in why


def test_a_child_of_a_process_without_cuda_inherits_no_context() -> None:
    import torch  # noqa: F401 - the check reads torch.cuda's fork flag

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, b"1" if inherited_cuda_context() else b"0")
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"0"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
