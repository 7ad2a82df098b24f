"""Fault toolkit: a seeded, declarative schedule of faults injected into a running spotrun job, with a journal.

Data flow: ``schedule`` (what to inject, when; pure) -> ``targets`` (which PID, which etcd member; reads /proc
and etcd's status API) -> ``injector`` (sends the signal, restarts the member, flips the storage faults) ->
``journal`` (one JSON line per injected fault). ``storage`` is an fsspec filesystem (protocol ``chaos``) that
injects storage errors, latency and disk full into a checkpoint location. ``cli`` is ``spotrun-chaos``.
"""

from elastic.chaos.api import (
    ChaosError,
    ChaosScheduleError,
    ChaosTargetError,
    Fault,
    FaultKind,
    FaultSkipped,
    Schedule,
)

__all__ = [
    "ChaosError",
    "ChaosScheduleError",
    "ChaosTargetError",
    "Fault",
    "FaultKind",
    "FaultSkipped",
    "Schedule",
]
