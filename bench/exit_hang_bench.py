"""Count hangs at exit of a script that calls ``dist.destroy_process_group()`` with its DDP module alive, under
spotrun with warm workers, spotrun with ``--no-warm-workers`` and stock torchrun (drop-in: all three must agree).

A run that has not ended ``--hang-after`` seconds after its start counts as hung: each of its workers gets a
``py-spy dump --native`` (when py-spy is on PATH or next to the interpreter) into ``--dump-dir``, then the run's
session is SIGKILLed. Runs go one at a time; ``--load K`` keeps K busy loops on the cores during the runs.

    python bench/exit_hang_bench.py --runs 20 --modes warm,cold,torchrun [--load 2] [--script quickstart]

As a stress check (exit status 1 on any exit deadlock or failed run; the last line says how many of each):

    python bench/exit_hang_bench.py --runs 100 --modes warm --check
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def command(mode: str, script: str, steps: int, ckpt_dir: str) -> list[str]:
    """``mode``: warm, cold (spotrun --no-warm-workers), torchrun, or torchrun-preimport[-dynamo|-rest]
    (torchrun, the script importing first what the warm forkserver preloads: all, only torch._dynamo, the rest);
    a ``-gcfreeze`` suffix: the script calls ``gc.freeze()`` after those imports."""
    if script == "quickstart":
        target = [str(ROOT / "examples" / "quickstart.py"), "--ckpt-dir", ckpt_dir, "--steps", str(steps)]
    else:
        target = [str(ROOT / "bench" / "exit_hang_script.py"), "--steps", str(steps)]
        if "-preimport" in mode:  # torchrun-preimport[-dynamo|-rest]
            variant = mode.split("-preimport")[1].removesuffix("-gcfreeze").lstrip("-")
            target += ["--preimport", variant or "all"]
        if mode.endswith("-gcfreeze"):
            target.append("--gc-freeze")
    if mode.startswith("torchrun"):
        return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", *target]
    flags = ["--no-hang-detection", "--warm-workers" if mode == "warm" else "--no-warm-workers"]
    return [str(BIN / "spotrun"), "--standalone", "--nproc-per-node", "2", *flags, *target]


def session_pids(sid: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "-o", "pid=,sid=,args=", "-e"], capture_output=True, text=True, check=False).stdout
    found = []
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[1] == str(sid):
            found.append((int(parts[0]), parts[2]))
    return found


def worker_pids(leader: int) -> list[int]:
    """Every process below ``leader`` (workers start their own sessions, so walk the parent links)."""
    out = subprocess.run(["ps", "-o", "pid=,ppid=", "-e"], capture_output=True, text=True, check=False).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        pid, ppid = (int(x) for x in line.split())
        children.setdefault(ppid, []).append(pid)
    seen, todo = [], [leader]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            seen.append(child)
            todo.append(child)
    return seen


def stack_command(pid: int) -> list[str] | None:
    """``py-spy dump --native`` when py-spy is on PATH or next to the interpreter, else gdb's native backtrace of
    every thread (it names the same C++ frames, ``~ProcessGroupGloo`` included); None when neither is there (a hung
    run then cannot be told from a slow one: the summary counts those apart instead of dropping them silently)."""
    spy = shutil.which("py-spy") or (str(BIN / "py-spy") if (BIN / "py-spy").exists() else None)
    if spy:
        return [spy, "dump", "--native", "--pid", str(pid)]
    gdb = shutil.which("gdb")
    if gdb:
        return [gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"]
    return None


def dump(pids: list[int], path: Path) -> None:
    with path.open("w") as out:
        for pid in pids:
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:300]
            except OSError:
                continue
            out.write(f"===== pid {pid}: {args}\n")
            out.flush()
            cmd = stack_command(pid)
            if cmd is None:
                out.write("no stack: neither py-spy nor gdb found\n")
                continue
            try:
                subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=60, check=False)
            except subprocess.TimeoutExpired:
                out.write(f"no stack: {cmd[0]} timed out\n")


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run's processes except multiprocessing's resource trackers: they exit once the others are gone
    and unlink the semaphores those leaked (killed with them, each run would leave ~9 ``sem.mp-*`` in /dev/shm)."""
    pids = [pid for pid in worker_pids(proc.pid) if b"resource_tracker" not in _cmdline(pid)]
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per mode")
    parser.add_argument("--modes", default="warm,cold,torchrun")
    parser.add_argument("--script", choices=("minimal", "quickstart"), default="minimal")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--load", type=int, default=0, help="busy loops kept on the cores during the runs")
    parser.add_argument("--hang-after", type=float, default=45.0)
    parser.add_argument("--dump-dir", default="/tmp/warmhang/dumps")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if any run deadlocked at exit or ended with a non-zero exit code")
    args = parser.parse_args()
    Path(args.dump_dir).mkdir(parents=True, exist_ok=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    counts: dict[str, list[int]] = {}
    slow: dict[str, int] = {}
    failed: dict[str, int] = {}
    if stack_command(os.getpid()) is None:
        print("warning: neither py-spy nor gdb found: hung runs cannot be told from slow ones", flush=True)
    try:
        for i in range(args.runs):
            for mode in args.modes.split(","):  # interleaved: the machine's load hits every mode alike
                with tempfile.TemporaryDirectory(prefix="warmhang-") as tmp:
                    began = time.monotonic()
                    deadlock = False
                    log = Path(args.dump_dir) / f"{args.script}-{mode}-{i}-load{args.load}.log"
                    with log.open("wb") as out:
                        # TMPDIR: torch's log dirs and the embedded etcd's data go with the run's temporary dir.
                        proc = subprocess.Popen(command(mode, args.script, args.steps, tmp + "/ckpt"), stdout=out,
                                                stderr=subprocess.STDOUT, env=dict(env, TMPDIR=tmp), cwd=ROOT,
                                                start_new_session=True)
                        try:
                            rc = proc.wait(args.hang_after)
                            hung = False
                        except subprocess.TimeoutExpired:
                            hung = True
                            dump(worker_pids(proc.pid), log.with_suffix(".dump"))
                            kill_tree(proc)
                            rc = proc.returncode
                            deadlock = "ProcessGroupGloo::~ProcessGroupGloo" in log.with_suffix(".dump").read_text(
                                errors="replace")
                    took = time.monotonic() - began
                    if not hung:
                        log.unlink()
                    # A run past --hang-after whose dump shows no exit deadlock was only slow (a loaded machine).
                    verdict = "ok" if not hung else "HUNG(exit deadlock)" if deadlock else "TIMEOUT(no deadlock stack)"
                    if not hung and rc != 0:
                        failed[mode] = failed.get(mode, 0) + 1
                    if not hung or deadlock:  # a slow run says nothing either way
                        counts.setdefault(mode, []).append(int(hung))
                    else:
                        slow[mode] = slow.get(mode, 0) + 1
                    load1 = os.getloadavg()[0]
                    print(f"{args.script} {mode} run {i}: {verdict} rc={rc} {took:.1f}s load={load1:.1f}", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    for mode in args.modes.split(","):
        hangs = counts.get(mode, [])
        print(f"SUMMARY script={args.script} load={args.load} {mode}: {sum(hangs)} exit deadlocks of {len(hangs)} runs "
              f"({slow.get(mode, 0)} slow runs without the deadlock stack left out)",
              flush=True)
    deadlocks = sum(sum(hangs) for hangs in counts.values())
    if args.check:
        print(f"CHECK {'FAILED' if deadlocks or failed else 'passed'}: {deadlocks} exit deadlocks, "
              f"{sum(failed.values())} failed runs, {sum(slow.values())} slow runs", flush=True)
        if deadlocks or failed:
            sys.exit(1)


if __name__ == "__main__":
    main()
