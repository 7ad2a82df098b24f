"""A real Slurm on one host for the deploy tests: munged, slurmctld and four ``slurmd -N nK`` on 127.0.0.1.

Debian's ``slurm-wlm`` (22.05 on bookworm) and ``munge`` packages, as a cluster runs them, except that every
daemon runs in the foreground as a child of the test (``-D``/``-F``), with its configuration, state, spool,
pid and log files in one temporary directory and its ports picked free: nothing under /etc, /var or /run is
read or written (the munge key, socket and seed are the lab's own; ``SLURM_CONF`` points every client at the
lab's slurm.conf). ``proctrack/linuxproc`` tracks a step's processes by parentage and Slurm signals every
one of them (the agents and their workers), as ``proctrack/cgroup`` does on most clusters.

:func:`unavailable_reason` says why the lab cannot start here (not root, packages missing and no apt-get);
the tests then fail with that reason (``.ci/slurm.sh`` installs the packages on CI). :meth:`SlurmLab.close`
cancels every job, waits for their steps to end, then stops the daemons by PID and kills (by PID) whatever
of theirs is left: ``slurmstepd`` is double-forked by ``slurmd`` and re-parented to the test session, which
is a child subreaper (tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.harness.procs import Timeout, descendants, free_port, pid_alive, signal_all, wait_for

NODES = ("n1", "n2", "n3", "n4")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "sinfo", "scancel", "sacct")
INSTALL_HINT = "bash .ci/slurm.sh (apt-get install slurm-wlm munge, as CI does)"


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def unavailable_reason() -> str | None:
    """Why a real Slurm cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "not root: slurmd runs job steps as their user and must be root"
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if missing:
        return f"{', '.join(missing)} not installed; run {INSTALL_HINT}"
    return None


@dataclass(frozen=True, slots=True)
class Job:
    """One job's state as ``scontrol show job`` tells it."""

    id: int
    state: str
    """PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ..."""
    exit_code: str
    """``rc:signal`` of the batch script."""
    restarts: int


class SlurmLab:
    """munged + slurmctld + one slurmd per node of :data:`NODES`, all on 127.0.0.1, under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # --- start and stop ------------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmLab:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn("munged", [self._bin("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                               f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}"])
        wait_for(self.munge_socket.exists, 15, "munged's socket")
        self._write_conf()
        self._spawn("slurmctld", [self._bin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(f"slurmd-{node}", [self._bin("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        try:
            wait_for(self._all_idle, timeout, "four idle Slurm nodes", interval=0.5)
        except Timeout as exc:
            raise Timeout(f"{exc}\n{self.logs()}") from None
        return self

    def _bin(self, name: str) -> str:
        path = _which(name)
        assert path is not None, f"{name} not installed; run {INSTALL_HINT}"
        return path

    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (closed in close())
        self._logs.append(log)
        self._procs[name] = subprocess.Popen(list(argv), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)

    def _write_conf(self) -> None:
        ctld_port = free_port()
        lines = [
            "ClusterName=spotrun-lab",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: a requeued job waits this long before it may start again (default 120 s).
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",
            "SelectType=select/linear",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log'}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # Short waits: the lab's jobs are short, and a leftover step must not hold the teardown for minutes.
            "KillWait=10",
            "MinJobAge=600",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "MessageTimeout=20",
        ]
        for node in NODES:
            lines.append(f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} CPUs=1 "
                         "State=UNKNOWN")
        lines.append(f"PartitionName=lab Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _all_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(node) == "idle" for node in NODES)

    def close(self) -> None:
        """Cancel every job and stop every daemon (by PID); kill what is left of their processes."""
        try:
            if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
                self.run(["scancel", "--full", "--user=root"], check=False, timeout=20)
                try:
                    wait_for(lambda: not self.run(["squeue", "-h"], check=False, timeout=20).stdout.strip(), 40,
                             "the lab's jobs to end", interval=0.5)
                except Timeout:
                    pass
        finally:
            mine = os.getpid()
            before = set(descendants(mine))
            for name in reversed(list(self._procs)):
                proc = self._procs[name]
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in self._procs.values():
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            # slurmstepd and job-step processes still alive: descendants of this session (slurmd double-forks
            # slurmstepd, which is re-parented to the session, a subreaper) that this lab started (their command
            # line or environment says so).
            left = [pid for pid in before if pid_alive(pid) and self._belongs_to_lab(pid)]
            signal_all(left, signal.SIGKILL)
            for log in self._logs:
                log.close()

    def _belongs_to_lab(self, pid: int) -> bool:
        """A slurmstepd (or one of its step's processes) of this lab: its command line or its environment
        names the lab's configuration."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmd = handle.read()
            if b"slurmstepd" in cmd:
                return True
            with open(f"/proc/{pid}/environ", "rb") as handle:
                return f"SLURM_CONF={self.conf}".encode() in handle.read().split(b"\0")
        except OSError:
            return False

    # --- clients -------------------------------------------------------------------------------------------

    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([self._bin(argv[0]), *argv[1:]], env=self.env, capture_output=True, text=True,
                                timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {result.returncode}: {result.stderr.strip()}\n{self.logs()}")
        return result

    def sbatch(self, script: Path, *options: str, env: dict[str, str], cwd: Path) -> int:
        """Submit ``script`` as written (``options`` before it override its ``#SBATCH`` lines); the job id."""
        result = subprocess.run([self._bin("sbatch"), "--parsable", *options, str(script)], cwd=cwd,
                                env={**env, "SLURM_CONF": str(self.conf)}, capture_output=True, text=True,
                                timeout=30, check=False)
        if result.returncode != 0:
            raise AssertionError(f"sbatch: exit {result.returncode}: {result.stderr.strip()}\n{self.logs()}")
        return int(result.stdout.strip().split(";")[0])

    def fields(self, job_id: int) -> dict[str, str]:
        """``scontrol -o show job``'s ``Key=Value`` fields."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def job(self, job_id: int) -> Job:
        fields = self.fields(job_id)
        return Job(job_id, fields.get("JobState", "?"), fields.get("ExitCode", "?"), int(fields.get("Restarts", "0")))

    def wait_job(self, job_id: int, states: Sequence[str], timeout: float) -> Job:
        """Poll until the job is in one of ``states``; fails with the lab's logs otherwise."""
        seen: list[Job] = []

        def reached() -> Job | None:
            job = self.job(job_id)
            seen.append(job)
            return job if job.state in states else None

        try:
            return wait_for(reached, timeout, f"job {job_id} to reach {'/'.join(states)}", interval=0.5)
        except Timeout as exc:
            raise Timeout(f"{exc}; last seen {seen[-1] if seen else None}\n{self.logs()}") from None

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)
