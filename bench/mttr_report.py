"""MTTR report: how long each recovery stage took, per fault type and recovery cause.

    python bench/mttr_report.py --events run/events.jsonl [--journal run/journal.jsonl] \\
        [--progress run/progress.jsonl] [--worker-log run/agent.log ...]

A thin wrapper kept for the benches and their scripts: the analysis lives in the installed
:mod:`elastic.report` (``spotrun report``, which adds the job's timeline, totals and ``--html``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.events import read_events
from elastic.report import (  # noqa: F401 - re-exported for bench/chaos_soak.py and the tests
    NO_RECOVERY,
    STAGES,
    Fault,
    NodeRecovery,
    Recovery,
    attribute,
    faults_from,
    job_recoveries,
    node_recoveries,
    recoveries,
    render,
    resume_times,
    summarize,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--events", action="append", required=True, help="events.jsonl (repeatable: one per agent dir)")
    p.add_argument("--journal", default=None, help="chaos journal (spotrun-chaos --journal)")
    p.add_argument("--progress", default=None, help="train_ddp.py --progress-file (first step, steps lost)")
    p.add_argument("--worker-log", action="append", default=[], help="log with train_ddp.py's output (repeatable)")
    args = p.parse_args(argv)
    events = [e for path in args.events for e in read_events(path)]
    journal = read_events(args.journal) if args.journal else []
    progress = read_events(args.progress) if args.progress else None
    resumes = ([t for log in args.worker_log for t in resume_times(Path(log).read_text(errors="replace"))]
               if args.worker_log else None)
    recs = recoveries(events, journal, progress, resumes)
    if not recs:
        print("no recovery in the events and no injected fault in the journal")
        return 1
    print("seconds from the fault to each stage (cumulative), median / worst per fault type and recovery cause")
    print(render(summarize(recs)))
    missing = []
    if resumes is None:
        missing.append("checkpoint_load: events.jsonl has no checkpoint-load event; pass --worker-log")
    if progress is None:
        missing.append("first_step, steps lost: pass --progress")
    if not journal:
        missing.append("no --journal: the clock starts at each detection (detection is 0), fault type '-'")
    for line in missing:
        print(f"n/a {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
