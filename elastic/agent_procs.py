"""How the agent handles its worker processes where torch's defaults hurt recovery (each place marked ``CHANGE:``).

Stopping with a short SIGTERM->SIGKILL grace (torch waits 30 s), also when torch's process context closes the
survivors of a crashed worker; letting go at once a worker that already returned; a failure summary that names
every rank that failed on its own, root cause first; one log line per failed worker; workers tied to the
agent's life by a parent-death signal. The torch internals used are checked by ``elastic.torch_internals``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_sentinels

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec
from torch.distributed.elastic.multiprocessing import PContext, ProcessFailure

from elastic.torch_internals import worker_processes, worker_return_values
from elastic.workers import PdeathsigEntrypoint, shim_command, signal_worker, terminate_processes, wait_for_workers


class OneLineWorkerFailure(logging.Filter):
    """CHANGE: torch's ``MultiprocessContext._poll`` logs every failed worker with ``logger.exception``: the
    traceback of torch's own ``join()`` (or the worker's whole traceback, which the worker already printed and
    its error file holds), lines of noise on every peer loss. Keep the record, as one line with the
    exception's first line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.msg, str) and record.msg.startswith("failed (exitcode"):
            exc = record.exc_info[1]
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            record.msg += ": %s (worker output and error file have the details)"
            record.args = (*(record.args or ()), first)
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_worker_failure_tracebacks() -> None:
    """Install :class:`OneLineWorkerFailure` on torch's process-context logger (once)."""
    torch_logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, OneLineWorkerFailure) for f in torch_logger.filters):
        torch_logger.addFilter(OneLineWorkerFailure())


def complete_failures(
    failures: dict[int, ProcessFailure],
    pcontext: PContext,
    worker_group: WorkerGroup,
    *,
    died_at: dict[int, float],
    close_started_at: float | None,
) -> dict[int, ProcessFailure]:
    """Every rank that failed on its own, by global rank, in the order they died (root cause first). A worker
    that had returned and was SIGKILLed only to release it (``_RELEASED``) is no failure, whatever torch says."""
    released = _RELEASED.get(pcontext, set())
    merged = {rank: f for rank, f in failures.items() if f.local_rank not in released}
    pids = pcontext.pids()
    for local_rank, when in died_at.items():
        global_rank = worker_group.workers[local_rank].global_rank
        exitcode = _exitcode(pcontext, local_rank)
        # <=: the agent notes the deaths it saw itself (DeathClock.note) just before it starts the close, on the
        # same monotonic clock, so a tie is a death seen before the close.
        on_its_own = close_started_at is None or when <= close_started_at
        if global_rank in merged or not on_its_own or exitcode == 0 or local_rank in released:
            continue
        merged[global_rank] = ProcessFailure(
            local_rank=local_rank, pid=pids.get(local_rank, -1), exitcode=exitcode,
            error_file=pcontext.error_files[local_rank],
        )
    return dict(sorted(merged.items(), key=lambda item: failure_order(item[1], died_at)))


def failure_order(failure: ProcessFailure, died_at: dict[int, float]) -> tuple[float, int, float, float]:
    """Sort key, root cause first: death time when known; in a tie (deaths noted together: the death clock's
    thread ran late), a worker killed by a signal before one that raised, since a peer's death breaks the others'
    collective into an exception, never into a signal; then the error file's timestamp and mtime (sub-second).
    A worker without an error file gets torch's "now" as its timestamp, which alone would rank it last."""
    try:
        mtime = os.stat(failure.error_file).st_mtime
    except OSError:
        mtime = float("inf")
    return (died_at.get(failure.local_rank, float("inf")), 0 if failure.exitcode < 0 else 1, failure.timestamp, mtime)


def _exitcode(pcontext: PContext, local_rank: int) -> int:
    """Exit code of a worker of a MultiprocessContext (1, like an uncaught exception, if unknown)."""
    processes = worker_processes(pcontext)
    exitcode = processes[local_rank].exitcode if processes and local_rank < len(processes) else None
    return 1 if exitcode is None else exitcode


def default_close_timeout(pcontext: PContext, grace: float, on_close: Callable[[], None]) -> None:
    """CHANGE: when one worker fails, torch's ``PContext._poll`` calls ``self.close()`` with its 30 s default
    SIGTERM->SIGKILL wait for the surviving workers, inside ``_monitor_workers``. Survivors blocked in a
    collective with the dead worker ignore SIGTERM, so that alone costs 30 s per crash. Calls without an
    explicit timeout get ``grace`` instead; explicit ones (``--shutdown-timeout`` on agent exit) are kept."""
    original = pcontext.close

    def close(death_sig: signal.Signals | None = None, timeout: float | None = None) -> None:
        on_close()
        wait = grace if timeout is None else timeout
        began = time.monotonic()
        stop_processes(pcontext, death_sig or signal.SIGTERM, wait)
        original(death_sig, max(0.0, wait - (time.monotonic() - began)))  # type: ignore[arg-type]  # torch says int; any seconds work

    pcontext.close = close  # type: ignore[method-assign]  # this instance only (CHANGE above)


def stop_processes(pcontext: PContext, sig: signal.Signals, grace: float) -> None:
    """Signal every live worker, wait up to ``grace`` s, SIGKILL the rest; a worker whose script already
    returned is let go at once (``_stop_releasing_returned_workers``). Every path by which the agent stops its
    workers goes through here, so a warm worker that exited 0 on the SIGTERM never sits in torch's ``_wrap``
    for the whole grace (long enough for the agent's lease to lapse on a loaded machine)."""
    began = time.monotonic()
    _stop_releasing_returned_workers(pcontext, sig, grace)
    # CHANGE (warm workers): torch's MultiprocessContext signals only each worker's PID; warm workers lead
    # their own process group like torchrun's subprocess workers, so signal the group (DataLoader workers
    # too), as torch's SubprocessHandler.close does. torch's close then only joins and closes log tails.
    remaining = max(0.0, grace - (time.monotonic() - began))
    terminate_processes(worker_processes(pcontext) or [], remaining, sig)


_RELEASED: weakref.WeakKeyDictionary[PContext, set[int]] = weakref.WeakKeyDictionary()
"""Local ranks of each process context that had returned (script done, exit 0) and were SIGKILLed only to let
them out of torch's ``_wrap``: their -9 is not a failure (``complete_failures``), as under torchrun they exit 0."""


def _stop_releasing_returned_workers(pcontext: PContext, death_sig: signal.Signals, timeout: float) -> None:
    """CHANGE: a function worker that already returned waits in torch's ``_wrap`` for the agent's next poll
    (``_worker_finished_event``); an agent that is closing never polls again, so a worker that exited 0 on
    SIGTERM (a hand-written save handler) held the agent and its lease for the whole 30 s timeout. Setting
    the event is unsafe (torch: it deadlocks if a process died inside ``wait()``), so a worker whose return
    value is already queued, i.e. that has nothing left to do, is SIGKILLed at once instead."""
    processes = worker_processes(pcontext)
    ret_vals = worker_return_values(pcontext)
    if not processes or ret_vals is None:
        return

    released = _RELEASED.setdefault(pcontext, set())

    for proc in processes:
        if proc.is_alive() and proc.pid is not None:  # alive implies started, so a pid
            signal_worker(proc.pid, death_sig)  # its process group when it leads one (warm workers)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [(rank, proc) for rank, proc in enumerate(processes) if proc.is_alive()]
        if not alive:
            return
        for rank, proc in alive:
            queue = ret_vals.get(rank)
            if queue is not None and not queue.empty() and proc.pid is not None:
                released.add(rank)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        wait_for_sentinels([proc.sentinel for _, proc in alive], timeout=min(0.1, max(0.0, deadline - time.monotonic())))


def tie_entrypoint_to_agent(spec: WorkerSpec) -> WorkerSpec:
    """Route the worker command through the PDEATHSIG exec shim (same PID, env and stdio after exec)."""
    if isinstance(spec.entrypoint, str):
        entrypoint, args = shim_command(spec.entrypoint, tuple(spec.args))
        spec.entrypoint = entrypoint
        spec.args = args
    elif callable(spec.entrypoint):
        spec.entrypoint = PdeathsigEntrypoint(spec.entrypoint)
    return spec


def wait_for_workers_or(pcontext: PContext | None, timeout: float, done: Callable[[], bool], poll: float) -> None:
    """Up to ``timeout`` s, returning as soon as a local worker returns or exits, or ``done()`` (asked every
    ``poll`` s): the monitor loop's wait while the workers head for an agreed step."""
    processes = worker_processes(pcontext) if pcontext is not None else None
    returns = worker_return_values(pcontext)
    began = time.monotonic()
    while True:
        remaining = timeout - (time.monotonic() - began)
        if remaining <= 0 or done():
            return
        if wait_for_workers(processes, returns, min(poll, remaining)):
            # never spin: a worker that returned stays "ready" until torch's next poll has read it
            time.sleep(max(0.0, min(timeout, 0.01) - (time.monotonic() - began)))
            return
