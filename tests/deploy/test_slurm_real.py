"""deploy/slurm/spotrun.sbatch as written under a real Slurm (Debian's slurm-wlm 22.05 and munge): four
``slurmd -N nK`` on 127.0.0.1 (``slurmlab``), one etcd, ``sbatch`` of the script with only what a user sets
(ETCD, CKPT, STEPS) and the options a user adds on the command line.

Slurm signals every process of the job step, the agents' workers and the warm forkserver included, which the
stand-in ``srun`` of test_deploy_run.py never does. The cases:

* ``--signal=TERM@50`` and a time limit: at the time-limit warning every node commits one agreed step, every agent
  exits 0 and the job ends COMPLETED (so ``--requeue`` can bring it back);
* ``scontrol requeue`` of that job: it resumes from the agreed step under a fresh rendezvous id and, at its own
  time-limit warning, commits a later step;
* one node's step lost (its agent SIGKILLed): the other three re-form at world size 6 and keep training.

Timing: each job's limit is shortened once it trains, so that the warning comes within about a minute
(``Job.limit_for_warning``). Without root or without the packages
the tests fail with the reason (``bash .ci/slurm.sh`` installs them; ``SPOTRUN_TEST_SKIP_SLURM=1`` skips the
module, saying so).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastic.etcd_server import EmbeddedEtcd
from tests.deploy import manifests as m
from tests.deploy.slurmlab import SlurmLab, unavailable_reason
from tests.harness.procs import pid_alive, proc_table, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(300)]

SKIP_ENV = "SPOTRUN_TEST_SKIP_SLURM"
NODES = 4
WORLD = NODES * (os.cpu_count() or 1)  # --nproc-per-node=auto on a CPU-only host: one worker per CPU
# The time-limit warning as a user asks for it (spotrun.sbatch's own is TERM@120; 50 s is ample for this
# model's save). slurmctld sends it at the first of its looks (every 30 s, PERIODIC_TIMEOUT) that is within
# warning + 30 s of the limit. Each job starts with a long limit and gets a short one once it trains (see
# Job.limit_for_warning): a warning before the workers run stops the agents at once (exit 1), and the agents'
# start varies from 10 s to more than a minute with the machine's load.
WARNING_S = 50
TIME_LIMIT = ("--time=10", f"--signal=TERM@{WARNING_S}")
PERIODIC_S = 30
LEFT = re.compile(r"left the group for the preemption notice \((step (\d+) committed|nothing saved[^)]*)\)")
STEP_LINE = re.compile(r"^step=(\d+) loss=\S+ world_size=(\d+)$", re.M)
EVENTS = re.compile(r"spotrun agent: run_id=(\S+) .* events=(\S+)")


@dataclass
class Lab:
    slurm: SlurmLab
    etcd: EmbeddedEtcd
    root: Path

    def env(self, ckpt: Path, steps: int) -> dict[str, str]:
        venv_bin = str(Path(sys.executable).parent)
        return {"PATH": os.pathsep.join([venv_bin, "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
                "HOME": str(self.root), "USER": "root", "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
                "LOGLEVEL": os.environ.get("LOGLEVEL", "INFO"),
                "ETCD": self.etcd.endpoint, "CKPT": str(ckpt), "STEPS": str(steps)}

    def submit(self, name: str, *options: str, steps: int = 100_000) -> Job:
        ckpt = self.root / f"{name}-ckpt"
        out = self.root / f"{name}.out"
        job_id = self.slurm.sbatch(m.SBATCH, f"--output={out}", *options, env=self.env(ckpt, steps), cwd=m.REPO)
        return Job(self, job_id, ckpt, out)


@dataclass
class Job:
    lab: Lab
    id: int
    ckpt: Path
    out: Path

    def output(self, start: int = 0) -> str:
        try:
            return self.out.read_bytes()[start:].decode(errors="replace")
        except FileNotFoundError:
            return ""

    def latest(self) -> int | None:
        try:
            return int((self.ckpt / "latest").read_text().strip().removeprefix("step-"))
        except (FileNotFoundError, ValueError):
            return None

    def context(self) -> str:
        return f"job {self.id} output (tail):\n{self.output()[-6000:]}\n{self.lab.slurm.logs()}"

    def wait(self, states: tuple[str, ...], timeout: float, restarts: int = 0) -> str:
        def reached() -> str | None:
            job = self.lab.slurm.job(self.id)
            return job.state if job.state in states and job.restarts == restarts else None

        try:
            return wait_for(reached, timeout, f"job {self.id} to end ({'/'.join(states)}, restarts={restarts})",
                            interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; now {self.lab.slurm.job(self.id)}\n{self.context()}") from None

    def wait_training(self, after: int = 0, timeout: float = 180.0) -> None:
        """Until a checkpoint later than step ``after`` is committed."""
        wait_for(lambda: (self.latest() or 0) > after, timeout, f"job {self.id} to commit a step after {after}")

    def limit_for_warning(self) -> None:
        """Shorten the running job's time limit (whole minutes) so that the warning comes within a minute and
        a half and still more than ``WARNING_S`` before the limit. The look that sends it is the first one
        past limit - WARNING_S - PERIODIC_S, so before limit - WARNING_S; with the limit at least
        WARNING_S + PERIODIC_S from now, a look due at once (within PERIODIC_S) is early enough too."""
        fields = self.lab.slurm.fields(self.id)
        hours, minutes, seconds = (int(x) for x in fields["RunTime"].split("-")[-1].split(":"))
        elapsed = hours * 3600 + minutes * 60 + seconds
        minutes_needed = -(-(elapsed + WARNING_S + PERIODIC_S) // 60)
        self.lab.slurm.run(["scontrol", "update", f"JobId={self.id}", f"TimeLimit={minutes_needed}"])

    def agents(self) -> dict[int, int]:
        """SLURM_PROCID -> pid of this job's spotrun agents (the processes slurmstepd started)."""
        table = proc_table()
        found = {}
        for pid, (ppid, _state, cmd) in table.items():
            if "spotrun" not in cmd or "slurmstepd" not in table.get(ppid, (0, "", ""))[2]:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as handle:
                    env = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
            except OSError:
                continue
            if env.get(b"SLURM_JOB_ID") == str(self.id).encode():
                found[int(env[b"SLURM_PROCID"])] = pid
        return found


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    if os.environ.get(SKIP_ENV):
        pytest.skip(f"{SKIP_ENV} is set: the real-Slurm cases of deploy/slurm/spotrun.sbatch did not run")
    reason = unavailable_reason()
    if reason is not None:
        pytest.fail(f"cannot start a real Slurm for deploy/slurm/spotrun.sbatch: {reason} (or set {SKIP_ENV}=1 "
                    "to skip these cases on purpose)", pytrace=False)
    root = tmp_path_factory.mktemp("slurm-real")
    slurm = SlurmLab(root / "slurm")
    etcd = EmbeddedEtcd()
    try:
        slurm.start()
        etcd.start()
        yield Lab(slurm, etcd, root)
    finally:
        slurm.close()
        etcd.close()


def _leaves(text: str) -> list[str]:
    """Each agent's planned leave in ``text``: the committed step, or "nothing saved: why"."""
    return [match.group(2) or match.group(1) for match in LEFT.finditer(text)]


def _finished_events(text: str) -> list[dict]:
    """Each agent's last run_finished and planned_leave events, from the events file its log line names."""
    from tests.harness.procs import read_jsonl

    found = []
    for _run_id, path in EVENTS.findall(text):
        events = read_jsonl(Path(path))
        found.append({e["event"]: e for e in events if e["event"] in ("run_finished", "planned_leave")})
    return found


def _assert_committed(job: Job, step: int) -> None:
    assert job.latest() == step, job.context()
    step_dir = job.ckpt / f"step-{step:09d}"
    assert (step_dir / ".commit").exists(), job.context()
    assert json.loads((step_dir / "manifest.json").read_text())["world_size"] == WORLD


@dataclass
class TimeLimited:
    job: Job
    step: int
    """The step every node committed at the time-limit warning."""


@pytest.fixture(scope="module")
def time_limited(lab: Lab) -> TimeLimited:
    job = lab.submit("timelimit", *TIME_LIMIT)
    job.wait_training()
    job.limit_for_warning()
    state = job.wait(("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), timeout=200)
    text = job.output()
    leaves = _leaves(text)
    assert state == "COMPLETED", f"{lab.slurm.job(job.id)}\n{job.context()}"
    assert len(leaves) == NODES and len(set(leaves)) == 1 and leaves[0].isdigit(), job.context()
    return TimeLimited(job, int(leaves[0]))


def test_time_limit_signal_commits_one_step_on_every_node_and_the_job_completes(lab: Lab,
                                                                                time_limited: TimeLimited) -> None:
    job, step = time_limited.job, time_limited.step
    text = job.output()
    _assert_committed(job, step)
    # Every agent: a saved planned leave of that step, and exit 0 (also what COMPLETED says for the step).
    events = _finished_events(text)
    assert len(events) == NODES, job.context()
    for agent in events:
        assert agent["planned_leave"]["saved"] is True and agent["planned_leave"]["step"] == step, agent
        assert agent["run_finished"]["state"] == "SUCCEEDED" and agent["run_finished"]["exit_code"] == 0, agent
    # The workers took Slurm's own SIGTERM as the notice: none died of it, none was charged as a failure.
    for bad in ("exitcode: 255", "Traceback", "ChildFailedError", "failed during the planned stop",
                "lost its lease", "stopped by SIGTERM"):
        assert bad not in text, f"{bad!r} in the job's output\n{job.context()}"
    trained = [int(s) for s, world in STEP_LINE.findall(text) if int(world) == WORLD]
    assert trained and max(trained) <= step, job.context()


def test_requeue_resumes_from_the_agreed_step(lab: Lab, time_limited: TimeLimited) -> None:
    job, step = time_limited.job, time_limited.step
    start = len(job.out.read_bytes())
    lab.slurm.run(["scontrol", "requeue", str(job.id)])
    # Pending again (for the lab's cred_expire): the long limit back, shortened once it trains again.
    lab.slurm.run(["scontrol", "update", f"JobId={job.id}", f"TimeLimit={TIME_LIMIT[0].split('=')[1]}"])
    job.wait_training(after=step)
    job.limit_for_warning()
    state = job.wait(("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), timeout=200, restarts=1)
    text = job.output(start)
    assert state == "COMPLETED", f"{lab.slurm.job(job.id)}\n{job.context()}"
    # A fresh rendezvous id per requeue (slurm-JOB-RESTARTS), the same checkpoint directory.
    assert {run_id for run_id, _ in EVENTS.findall(text)} == {f"slurm-{job.id}-1"}, job.context()
    logged = [int(s) for s, _ in STEP_LINE.findall(text)]
    assert logged and step < logged[0] <= step + 20, f"first step logged after the requeue: {logged[:3]}"
    leaves = _leaves(text)
    assert len(leaves) == NODES and len(set(leaves)) == 1 and leaves[0].isdigit(), job.context()
    later = int(leaves[0])
    assert later > step
    _assert_committed(job, later)


def test_a_lost_node_leaves_the_other_three_training(lab: Lab) -> None:
    job = lab.submit("nodeloss", "--time=5")
    try:
        job.wait_training()
        def all_agents() -> dict[int, int] | None:
            found = job.agents()
            return found if len(found) == NODES else None

        agents = wait_for(all_agents, 30, f"the {NODES} agents of job {job.id}")
        before = job.latest()
        assert before is not None
        start = len(job.out.read_bytes())
        os.kill(agents[1], signal.SIGKILL)  # node 1's step is lost: agent and (PDEATHSIG) its workers
        smaller = (NODES - 1) * (os.cpu_count() or 1)

        def trained_on() -> bool:
            latest = job.latest()
            if latest is None or latest <= before + 100:
                return False
            manifest = json.loads((job.ckpt / f"step-{latest:09d}" / "manifest.json").read_text())
            return manifest["world_size"] == smaller

        try:
            wait_for(trained_on, 120, "the three remaining nodes to commit a checkpoint at the smaller world size")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{job.context()}") from None
        assert any(int(w) == smaller for _, w in STEP_LINE.findall(job.output(start))), job.context()
        survivors = [pid for rank, pid in agents.items() if rank != 1]
        assert all(pid_alive(pid) for pid in survivors), job.context()
        assert lab.slurm.job(job.id).state == "RUNNING"
    finally:
        lab.slurm.run(["scancel", str(job.id)], check=False)
    job.wait(("CANCELLED", "COMPLETED", "FAILED"), timeout=120)


NOTICE_WINDOW_S = 40.0
"""The random moment of the notice is drawn from this many seconds after the job's agents appear: on two cores
the start (imports, the forkserver, eight workers' imports, init_process_group, the restore) takes 20-40 s, so
the draw lands in the start as often as in training (issue 27)."""
KEEPER_DIED = "while its agent lives"  # the keeper took the notice for its end (it must not)
KEEPER_STARTED = re.compile(r"memory tier keeper directory \S+ \(keeper pid \d+\)")


@pytest.mark.timeout(600)
def test_a_notice_at_a_random_moment_completes_the_job_and_requeue_resumes(lab: Lab) -> None:
    """``scancel --signal=TERM`` (what ``--signal`` and a preemption send: every process of the step) at a
    random moment of the job's life, the start included: every agent leaves as planned (exit 0), the job
    ends COMPLETED 0:0, no keeper takes the signal for its end, and a requeue resumes from the last commit."""
    seed = int(os.environ.get("SPOTRUN_TEST_SEED", str(time.time_ns() % 1_000_000)))
    delay = random.Random(seed).uniform(0.0, NOTICE_WINDOW_S)
    job = lab.submit("anymoment", "--time=10")
    context = f"seed {seed} (SPOTRUN_TEST_SEED reruns it): notice {delay:.1f} s after the agents appeared"
    try:
        wait_for(lambda: len(job.agents()) == NODES, 60, f"the {NODES} agents of job {job.id}", interval=0.05)
        appeared = time.monotonic()
        wait_for(lambda: time.monotonic() - appeared >= delay, delay + 5, "the drawn moment", interval=0.05)
        committed = job.latest()
        lab.slurm.run(["scancel", "--signal=TERM", str(job.id)])
        state = job.wait(("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), timeout=200)
    except AssertionError as exc:
        raise AssertionError(f"{context}\n{exc}") from None
    text = job.output()
    assert state == "COMPLETED" and lab.slurm.job(job.id).exit_code == "0:0", \
        f"{context}\n{lab.slurm.job(job.id)}\n{job.context()}"
    events = _finished_events(text)
    assert len(events) == NODES, f"{context}\n{job.context()}"
    for agent in events:
        assert agent["run_finished"]["exit_code"] == 0 and "planned_leave" in agent, f"{context}: {agent}"
    # Each agent ran a keeper (its INFO line names the pid): the check below is about live keepers, and one that
    # took the notice for its end would have made its agent log KEEPER_DIED and start another.
    assert len(KEEPER_STARTED.findall(text)) >= NODES, f"{context}: keepers started\n{job.context()}"
    for bad in ("Traceback", "stopped by SIGTERM", KEEPER_DIED):
        assert bad not in text, f"{context}: {bad!r} in the job's output\n{job.context()}"
    latest = job.latest()
    assert latest is None or committed is None or latest >= committed, context

    start = len(job.out.read_bytes())
    lab.slurm.run(["scontrol", "requeue", str(job.id)])
    try:
        wait_for(lambda: STEP_LINE.search(job.output(start)), 240, f"job {job.id} to train after the requeue")
        first = int(STEP_LINE.findall(job.output(start))[0][0])  # rank 0 logs every 20th step
        assert (latest or 0) < first <= (latest or 0) + 20, f"{context}: first logged step {first}, last commit {latest}"
    finally:
        lab.slurm.run(["scancel", str(job.id)], check=False)
    job.wait(("CANCELLED", "COMPLETED", "FAILED"), timeout=120, restarts=1)
