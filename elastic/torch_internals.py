"""Every torch internal spotrun's agent relies on, in one place, checked instead of guessed.

``SpotrunAgent`` copies ``SimpleElasticAgent._invoke_run``, overrides private hooks of ``LocalElasticAgent``,
patches ``PContext.close`` and reads ``MultiprocessContext._pc.processes``. None of that is public API: a torch
release may rename or reshape it. Two guards, so that such a change fails loudly instead of silently turning
a spotrun feature off:

* at run time, :func:`require` raises :class:`~elastic.api.TorchInternalsError` naming the internal and the
  torch release it was read from (the agent checks its hooks at construction, the rest where it is used);
* at test time, ``tests/elastic/test_torch_internals.py`` compares a hash of the source of each copied or
  overridden torch function with :data:`FINGERPRINTS` and names what to re-check when one differs.

The ``<2.14`` pin in pyproject.toml keeps users on the verified release; these guards tell whoever lifts it
what to read again.
"""

from __future__ import annotations

import inspect
import multiprocessing.process
from typing import Any, Final

import torch
from torch.distributed.elastic.multiprocessing import PContext
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

from elastic.api import TorchInternalsError

VERIFIED_TORCH: Final = "2.13"
"""The torch release whose internals the agent was written against (pyproject pins ``torch<2.14``)."""

AGENT_HOOKS: Final = (
    "_invoke_run", "_initialize_workers", "_rendezvous", "_start_workers", "_monitor_workers", "_stop_workers",
    "_restart_workers", "_shutdown", "_exit_barrier",
)
"""Private methods of torch's agent that ``SpotrunAgent`` overrides or calls."""

AGENT_STATE: Final = ("_worker_group", "_remaining_restarts", "_pcontext")
"""Private attributes of torch's agent that ``SpotrunAgent`` reads or writes."""


def require(condition: bool, internal: str, detail: str) -> None:
    """Raise :class:`TorchInternalsError` naming ``internal`` unless ``condition`` holds."""
    if not condition:
        raise TorchInternalsError(
            f"spotrun relies on the torch internal {internal} as of torch {VERIFIED_TORCH} (pinned <2.14), but the "
            f"installed torch {torch.__version__} differs: {detail}. Re-check the CHANGE: markers in "
            "elastic/agent.py against this torch release (tests/elastic/test_torch_internals.py names the functions)."
        )


def check_agent_internals(agent: object) -> None:
    """The private hooks and attributes of torch's agent that ``SpotrunAgent`` depends on all exist."""
    for name in AGENT_HOOKS:
        require(callable(getattr(agent, name, None)), f"SimpleElasticAgent.{name}", "the method is gone")
    for name in AGENT_STATE:
        require(hasattr(agent, name), f"SimpleElasticAgent.{name}", "the attribute is gone")
    params = list(inspect.signature(PContext.close).parameters)
    require(params[:3] == ["self", "death_sig", "timeout"], "PContext.close(death_sig, timeout)",
            f"its parameters are now {params}")


def worker_processes(pcontext: PContext) -> list[multiprocessing.process.BaseProcess] | None:
    """The ``multiprocessing`` processes of a started ``MultiprocessContext`` (function and warm-worker
    entrypoints); None for a ``SubprocessContext`` (binaries and the exec shim), which has no such objects."""
    if not isinstance(pcontext, MultiprocessContext):
        return None
    pc = getattr(pcontext, "_pc", None)
    processes = getattr(pc, "processes", None)
    require(isinstance(processes, list), "MultiprocessContext._pc.processes",
            f"a started context has _pc={type(pc).__name__} with processes={type(processes).__name__}, not a list")
    return processes


def worker_return_values(pcontext: PContext | None) -> dict[int, Any] | None:
    """``MultiprocessContext._ret_vals`` (local rank -> the queue a worker's return value arrives on); None
    for a ``SubprocessContext`` or no context. Read by the agent to wake when workers return and to release
    workers that already returned (see ``elastic.agent``)."""
    if not isinstance(pcontext, MultiprocessContext):
        return None
    ret_vals = getattr(pcontext, "_ret_vals", None)
    require(isinstance(ret_vals, dict), "MultiprocessContext._ret_vals",
            f"a started context has _ret_vals={type(ret_vals).__name__}, not a dict")
    return ret_vals
