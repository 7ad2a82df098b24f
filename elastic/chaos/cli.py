"""``spotrun-chaos``: inject a seeded fault schedule into a job and journal what was injected.

    spotrun-chaos --schedule s.json --journal j.jsonl [--progress-file p.jsonl] -- spotrun ... train.py ...
    spotrun-chaos --schedule s.json --journal j.jsonl --agent-pid 1234 --agent-pid 5678 --etcd-endpoints h:2379

With a command, it is started (its own session) and is the agent whose workers are targeted; the exit code is
the command's. With ``--agent-pid``, running agents are targeted and it returns once every fault has fired
and ended. Storage faults need the job's checkpoint location behind ``chaos::`` (e.g.
``--ckpt-dir chaos::file:///data/ckpt``); the control file is passed to the command as SPOTRUN_CHAOS_STORAGE.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from elastic.chaos.api import STORAGE_CONTROL_ENV, ChaosError, Schedule, restarts_needed
from elastic.chaos.injector import Injector
from elastic.chaos.journal import Journal
from elastic.chaos.schedule import load_schedule
from elastic.chaos.targets import last_step
from elastic.config import hang_policy
from elastic.options import EVENTS_FILE

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The ``spotrun-chaos`` parser (also read by ``docs/gen_reference.py`` for the flag reference)."""
    p = argparse.ArgumentParser(prog="spotrun-chaos", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--schedule", required=True, help="JSON schedule: {\"seed\": N, \"faults\": [...]}")
    p.add_argument("--journal", required=True, help="JSON-lines file of injected faults (appended)")
    p.add_argument("--progress-file", default=None, help="the job's --progress-file, for at_step triggers")
    p.add_argument("--agent-pid", type=int, action="append", default=[], help="target this running agent (repeat)")
    p.add_argument("--etcd-endpoints", default="", help="comma-separated etcd members (HOST:PORT) to target")
    p.add_argument("--events-file", default=None,
                   help="the job's spotrun --events-file: finds workers forked by the warm-worker forkserver "
                        "(default: the --events-file of the command, if any)")
    p.add_argument("--storage-control", default=None,
                   help="control file of the chaos:// filesystem (default: a temporary file given to the command)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the job to start (e.g. spotrun ... train.py)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if bool(args.command) == bool(args.agent_pid):
        p.error("give either a command after -- or --agent-pid, not both and not neither")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    try:
        schedule = load_schedule(args.schedule)
    except ChaosError as exc:
        print(f"spotrun-chaos: {exc}", file=sys.stderr)
        return 2
    control = args.storage_control
    owned_control = None
    if control is None and args.command:
        fd, owned_control = tempfile.mkstemp(prefix="spotrun-chaos-", suffix=".json")
        os.close(fd)
        os.unlink(owned_control)  # absent until a storage fault fires: pass-through
        control = owned_control
    if args.command:
        warn_if_restarts_short(schedule, args.command)
    endpoints = [e.strip() for e in args.etcd_endpoints.split(",") if e.strip()]
    journal = Journal(args.journal)
    step = (lambda: last_step(args.progress_file)) if args.progress_file else (lambda: None)
    proc = None
    if args.command:
        env = {**os.environ, STORAGE_CONTROL_ENV: control or ""}
        proc = subprocess.Popen(args.command, env=env)
        agents = [proc.pid]
    else:
        agents = args.agent_pid
    events_file = args.events_file or events_file_of(args.command)
    injector = Injector(schedule, journal, agent_pids=agents, etcd_endpoints=endpoints, storage_control=control,
                        events_file=events_file)
    journal.write("started", seed=schedule.seed, faults=len(schedule.faults), agents=agents, etcd=endpoints)
    forward = _forward_signals(proc)
    try:
        injector.run(done=(lambda: proc.poll() is not None) if proc else (lambda: False), step=step)
        code = proc.wait() if proc else 0
    finally:
        injector.close()
        forward()
        if owned_control and os.path.exists(owned_control):
            os.unlink(owned_control)
    journal.write("finished", exit_code=code, injected=len(injector.injected), pending=injector.pending())
    if injector.pending():
        logger.warning("spotrun-chaos: the job ended with %d faults not fired", injector.pending())
    return code


def events_file_of(command: list[str]) -> str | None:
    """The ``--events-file`` a spotrun command line (or its environment) names, so workers forked by the
    warm-worker forkserver can be found without repeating it."""
    for i, arg in enumerate(command):
        if arg in EVENTS_FILE.spellings and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(tuple(f"{s}=" for s in EVENTS_FILE.spellings)):
            return arg.split("=", 1)[1]
    return os.environ.get(EVENTS_FILE.env) or None


_LAUNCHERS = ("spotrun", "torchrun")
_LAUNCHER_MODULES = ("elastic.cli", "torch.distributed.run")
_PYTHON = re.compile(r"python[0-9.]*")


@dataclass(frozen=True, slots=True)
class LaunchBudget:
    """What a wrapped spotrun/torchrun command line allows for faults."""

    max_restarts: int
    """``--max-restarts`` (torchrun's default 0, or ``PET_MAX_RESTARTS``)."""
    hang_timeout: float | None
    """Seconds before a stopped worker counts as hung and is restarted (None: hang detection off)."""


def launch_budget(command: list[str]) -> LaunchBudget | None:
    """The restart budget of a spotrun or torchrun command line, read with spotrun's own parser (torchrun's
    flags, spellings, abbreviations and ``PET_*`` fallbacks, plus spotrun's); None for any other command or
    one the parser rejects (the launcher will say why)."""
    args = _launcher_args(command)
    if args is None:
        return None
    from elastic.cli import build_parser  # imports torch: only for a launcher command line

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the launcher itself reports a bad command line
            parsed, _ = build_parser().parse_known_args(args)
        policy = hang_policy(enabled=parsed.hang_detection, timeout=parsed.hang_timeout,
                             startup_timeout=parsed.hang_startup_timeout)
    except (SystemExit, ValueError):
        return None
    hang_timeout = None if policy is None else (policy.timeout if policy.timeout is not None else policy.floor)
    return LaunchBudget(max_restarts=int(parsed.max_restarts), hang_timeout=hang_timeout)


def _launcher_args(command: list[str]) -> list[str] | None:
    """The launcher's arguments in ``spotrun ...``, ``torchrun ...`` or ``python -m torch.distributed.run ...``
    (also ``elastic.cli``), else None."""
    if not command:
        return None
    program = os.path.basename(command[0])
    if program in _LAUNCHERS:
        return command[1:]
    if _PYTHON.fullmatch(program) and len(command) >= 3 and command[1] == "-m" and command[2] in _LAUNCHER_MODULES:
        return command[3:]
    return None


def restarts_shortfall(schedule: Schedule, budget: LaunchBudget) -> str | None:
    """The warning for a job that cannot survive the schedule's restarting faults, or None when it can."""
    needed = restarts_needed(schedule.faults, hang_timeout=budget.hang_timeout)
    if needed <= budget.max_restarts:
        return None
    return (f"the schedule injects {needed} fault(s) that each cost a restart (kill_worker, and stop_worker "
            f"found as a hang) but the command allows --max-restarts {budget.max_restarts}: the job ends at "
            f"fault {budget.max_restarts + 1}; pass --max-restarts {needed} (or more) to the launcher")


def warn_if_restarts_short(schedule: Schedule, command: list[str]) -> None:
    """Warn once, before the job starts, when the wrapped launcher has fewer restarts than the faults need."""
    budget = launch_budget(command)
    if budget is None:
        return
    message = restarts_shortfall(schedule, budget)
    if message is not None:
        logger.warning("spotrun-chaos: %s", message)


def _forward_signals(proc: subprocess.Popen[bytes] | None):  # type: ignore[no-untyped-def]
    """SIGTERM/SIGINT to spotrun-chaos go to the job (like a launcher); returns the restore function."""
    if proc is None:
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda s, _f: proc.send_signal(s))

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


if __name__ == "__main__":
    sys.exit(main())
