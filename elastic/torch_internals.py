"""Every torch internal spotrun relies on, in one place, checked instead of guessed.

``SpotrunAgent`` overrides the hooks ``SimpleElasticAgent`` declares for subclasses (its abstract
``_start_workers``, ``_stop_workers``, ``_monitor_workers``, ``_shutdown`` and the ``_rendezvous`` /
``_restart_workers`` steps around them), copies ``SimpleElasticAgent._invoke_run``, patches ``PContext.close``
and reads ``MultiprocessContext._pc`` / ``._ret_vals``; the launcher calls two private helpers of
``torch.distributed.launcher.api``; the CLI asks torch for its privateuse1 backend name; the checkpointer reads
a DTensor's piece through ``DTensor.__create_chunk_list__`` (the hook torch's own distributed checkpoint
plans with; declared with its accessor in ``checkpoint._sys.torch_internals``, below both packages). None of
that is a stable API: a torch release may rename or reshape it. So each is an :class:`Internal` of
:data:`INTERNALS`, guarded twice:

* at start, :func:`verify_torch` runs every internal's structural check (it exists, has the parameters
  spotrun calls it with, still sets the attributes spotrun reads) and raises :class:`TorchInternalsError`
  naming each one that fails and the torch releases known to work, before any etcd, rendezvous or worker
  exists. On a torch newer (or older) than :data:`TESTED_TORCH` it says once which internals it checked
  and runs when all pass;
* at test time, ``tests/elastic/test_torch_internals.py`` compares a hash of each internal's source with
  its fingerprint for the installed release (one per release in :data:`TESTED_TORCH`) and names what to
  re-check when one differs.

To support a new torch release: run ``python -m elastic.torch_internals`` under it, read every internal whose
hash differs (its ``reliance`` says what to look for), port what changed, add the release to
:data:`TESTED_TORCH` and its hashes to the fingerprints, and widen the range in pyproject.toml.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import multiprocessing.process
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch.distributed.elastic.multiprocessing import PContext
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

from checkpoint._sys.torch_internals import CHECKPOINT_INTERNALS
from checkpoint._sys.torch_internals import Internal as Internal
from checkpoint._sys.torch_internals import dtensor_local_chunk as dtensor_local_chunk
from elastic.api import TorchInternalsError

logger = logging.getLogger(__name__)

TESTED_TORCH: Final = ("2.13", "2.14", "2.15")
"""torch releases (major.minor) the suite runs on (2.13.0, 2.14.1, 2.15.0); pyproject.toml declares exactly these."""

_AGENT = "torch.distributed.elastic.agent.server"
_MP = "torch.distributed.elastic.multiprocessing.api"


INTERNALS: Final[tuple[Internal, ...]] = (
    # -- the agent: hooks SimpleElasticAgent declares for subclasses, and the loop spotrun copies
    Internal(f"{_AGENT}.api.SimpleElasticAgent._invoke_run",
             "SpotrunAgent._invoke_run is a copy with CHANGE: markers; port the change",
             params=("self", "role")),
    Internal(f"{_AGENT}.api.SimpleElasticAgent.__init__",
             "SpotrunAgent reads and writes self._worker_group and self._remaining_restarts",
             params=("self", "spec", "exit_barrier_timeout"),
             mentions=("self._worker_group =", "self._remaining_restarts =")),
    Internal(f"{_AGENT}.api.SimpleElasticAgent._initialize_workers",
             "SpotrunAgent._invoke_run calls it once before the monitor loop", params=("self", "worker_group")),
    Internal(f"{_AGENT}.api.SimpleElasticAgent._rendezvous",
             "SpotrunAgent._rendezvous wraps it (events, restart refund after a membership change)",
             params=("self", "worker_group")),
    Internal(f"{_AGENT}.api.SimpleElasticAgent._restart_workers",
             "SpotrunAgent restarts through it (stop, rendezvous, start)", params=("self", "worker_group")),
    Internal(f"{_AGENT}.api.SimpleElasticAgent._exit_barrier",
             "SpotrunAgent waits in it when its workers finished and no peer left", params=("self",)),
    Internal(f"{_AGENT}.local_elastic_agent.LocalElasticAgent.__init__",
             "SpotrunAgent passes these keywords and reads self._pcontext",
             params=("self", "spec", "logs_specs", "start_method", "exit_barrier_timeout", "log_line_prefix_template",
                     "shutdown_timeout"),
             mentions=("self._pcontext",)),
    Internal(f"{_AGENT}.local_elastic_agent.LocalElasticAgent._start_workers",
             "SpotrunAgent._start_workers expects it to set self._pcontext (close patch, DeathClock)",
             params=("self", "worker_group"), mentions=("self._pcontext = start_processes(",)),
    Internal(f"{_AGENT}.local_elastic_agent.LocalElasticAgent._monitor_workers",
             "SpotrunAgent._monitor_workers wraps it (early terminate, complete_failures)",
             params=("self", "worker_group")),
    Internal(f"{_AGENT}.local_elastic_agent.LocalElasticAgent._stop_workers",
             "SpotrunAgent._stop_workers replaces it with _shutdown(timeout=stop_grace)",
             params=("self", "worker_group")),
    Internal(f"{_AGENT}.local_elastic_agent.LocalElasticAgent._shutdown",
             "SpotrunAgent._stop_workers calls it with a short timeout", params=("self", "death_sig", "timeout")),
    # -- the workers' process context
    Internal(f"{_MP}.PContext.close",
             "agent._default_close_timeout wraps it and keeps its (death_sig, timeout) call shape",
             params=("self", "death_sig", "timeout")),
    Internal(f"{_MP}.MultiprocessContext.__init__",
             "torch_internals.worker_return_values reads the _ret_vals it sets (local rank -> return queue)",
             mentions=("self._ret_vals =",)),
    Internal(f"{_MP}.MultiprocessContext._poll",
             ("agent._default_close_timeout exists because _poll calls self.close() with the 30 s default; "
              "complete_failures because it reports only the first dead process; OneLineWorkerFailure matches "
              "its 'failed (exitcode' log line"),
             params=("self",)),
    Internal(f"{_MP}.MultiprocessContext._start", "torch_internals.worker_processes reads the _pc it sets",
             params=("self",), mentions=("self._pc = ",)),
    Internal("torch.multiprocessing.spawn.ProcessContext.join",
             "SpotrunAgent._monitor_workers terminates survivors itself because join waits 30 s before SIGKILL",
             params=("self", "timeout")),
    # -- the launcher and the CLI
    Internal("torch.distributed.launcher.api.launch_agent",
             "elastic.launcher.launch mirrors it step for step; port the change",
             params=("config", "entrypoint", "args")),
    Internal("torch.distributed.launcher.api._get_entrypoint_name",
             "elastic.launcher.launch names the failed entrypoint with it, as torchrun's summary does",
             params=("entrypoint", "args")),
    Internal("torch.distributed.launcher.api._get_addr_and_port",
             "elastic.launcher.launch takes the static backend's master address and port from it",
             params=("rdzv_parameters",)),
    Internal("torch._C._get_privateuse1_backend_name",
             "elastic.cli.validate_args accepts the registered privateuse1 backend as --nproc-per-node, as torchrun"),
    # -- the checkpointer (declared below both packages: checkpoint._sys.torch_internals)
    *CHECKPOINT_INTERNALS,
)
"""Every torch internal spotrun relies on (see the module docstring)."""

_FP_2_13: Final[dict[str, str]] = {  # 2.13.0
    f"{_AGENT}.api.SimpleElasticAgent._invoke_run": "376e457facabbfbc",
    f"{_AGENT}.api.SimpleElasticAgent.__init__": "317ff80c976993e7",
    f"{_AGENT}.api.SimpleElasticAgent._initialize_workers": "14311253e222ba2a",
    f"{_AGENT}.api.SimpleElasticAgent._rendezvous": "f0c843d67c04a7fc",
    f"{_AGENT}.api.SimpleElasticAgent._restart_workers": "7de319cd35c6f36e",
    f"{_AGENT}.api.SimpleElasticAgent._exit_barrier": "a61566b289e57086",
    f"{_AGENT}.local_elastic_agent.LocalElasticAgent.__init__": "dffaa0de4d27f02c",
    f"{_AGENT}.local_elastic_agent.LocalElasticAgent._start_workers": "3a15b68937f57e63",
    f"{_AGENT}.local_elastic_agent.LocalElasticAgent._monitor_workers": "4ba1c04fe76bba95",
    f"{_AGENT}.local_elastic_agent.LocalElasticAgent._stop_workers": "80fd695926105a38",
    f"{_AGENT}.local_elastic_agent.LocalElasticAgent._shutdown": "615c6a545ee67bcf",
    f"{_MP}.PContext.close": "b77c260c4568f068",
    f"{_MP}.MultiprocessContext.__init__": "eeddf1a3a91f03be",
    f"{_MP}.MultiprocessContext._poll": "5b291186e8aaa27a",
    f"{_MP}.MultiprocessContext._start": "7877a375514bf7e6",
    "torch.multiprocessing.spawn.ProcessContext.join": "785391c17c9e47af",
    "torch.distributed.launcher.api.launch_agent": "01534e5e0ad77098",
    "torch.distributed.launcher.api._get_entrypoint_name": "eda90c543dd3c28d",
    "torch.distributed.launcher.api._get_addr_and_port": "a57e1e59a1bcde3b",
    "torch.distributed.tensor.DTensor.__create_chunk_list__": "91672fc8acc41ac0",
}
_FP_2_14: Final[dict[str, str]] = {  # 2.14.1: _start_workers passes ${hostname} to the log prefix; _get_entrypoint_name: a docstring typo
    **_FP_2_13,
    f"{_AGENT}.local_elastic_agent.LocalElasticAgent._start_workers": "d86e8446ebadc6ea",
    "torch.distributed.launcher.api._get_entrypoint_name": "7a0fcc1193a2692d",
}
_FP_2_15: Final[dict[str, str]] = {  # 2.15.0: as 2.14, and launch_agent logs a failing rendezvous shutdown; ProcessContext.join: a comment
    **_FP_2_14,
    "torch.multiprocessing.spawn.ProcessContext.join": "b397949181930645",
    "torch.distributed.launcher.api.launch_agent": "285a3d8ba38e8d8a",
}
FINGERPRINTS: Final[Mapping[str, Mapping[str, str]]] = {
    # torch release -> {Internal.path: sha256[:16] of inspect.getsource in the tested patch release}. A C binding
    # (no Python source) has none; its structural check covers it. `python -m elastic.torch_internals` prints
    # the block for the installed torch.
    "2.13": _FP_2_13,
    "2.14": _FP_2_14,
    "2.15": _FP_2_15,
}
"""The source of every internal in each tested release (``tests/elastic/test_torch_internals.py`` compares)."""


# --------------------------------------------------------------------------- checks


def resolve(path: str) -> Any:
    """The object named by a dotted ``module.Class.attr`` path (longest importable module prefix).

    Raises:
        ImportError: no prefix of ``path`` is an importable module.
        AttributeError: the module lacks one of the attributes.
    """
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def source_hash(obj: Any) -> str:
    """sha256[:16] of an object's source, as in :data:`FINGERPRINTS`."""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def problem(internal: Internal) -> str | None:
    """What keeps spotrun from relying on ``internal`` in the installed torch, or None when it is usable."""
    owner_path, attr = internal.path.rsplit(".", 1)
    try:
        owner = resolve(owner_path)
        obj = getattr(owner, attr)
    except (ImportError, AttributeError) as exc:
        return f"it is gone ({exc})"
    if inspect.isclass(owner) and attr not in vars(owner):
        return f"{owner.__name__} no longer defines it (only inherits it)"
    if not callable(obj):
        return f"it is a {type(obj).__name__}, not a function"
    if internal.params is not None:
        try:
            params = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            params = None
        if params is not None and params[: len(internal.params)] != internal.params:
            return f"its parameters are now {list(params)}, spotrun expects {list(internal.params)} first"
    if internal.mentions:
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            return "its source is not available to check"
        missing = [text for text in internal.mentions if text not in source]
        if missing:
            return f"it no longer contains {', '.join(repr(m) for m in missing)}"
    return None


@dataclass(frozen=True, slots=True)
class TorchCheck:
    """The outcome of :func:`check_torch`: which internals were checked on which torch, which failed."""

    torch_version: str
    checked: tuple[str, ...]
    """Short names of every internal checked."""
    failed: Mapping[str, str]
    """Short name -> what differs, for each internal that failed its check."""

    @property
    def tested(self) -> bool:
        """The installed torch is one of :data:`TESTED_TORCH`."""
        return release_of(self.torch_version) in TESTED_TORCH


def release_of(version: str) -> str:
    """``"2.15"`` for ``"2.15.0+cu128"`` (the major.minor :data:`TESTED_TORCH` lists)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{match.group(1)}.{match.group(2)}" if match else version


def check_torch(version: str | None = None, internals: tuple[Internal, ...] = INTERNALS) -> TorchCheck:
    """Run every internal's structural check against the installed torch (``version`` overrides the version
    reported, for tests)."""
    failed = {i.name: detail for i in internals if (detail := problem(i)) is not None}
    return TorchCheck(torch_version=version or torch.__version__, checked=tuple(i.name for i in internals),
                      failed=failed)


def known_to_work() -> str:
    """``torch 2.13, 2.14 and 2.15``."""
    return f"torch {', '.join(TESTED_TORCH[:-1])} and {TESTED_TORCH[-1]}"


def verify_torch(version: str | None = None, internals: tuple[Internal, ...] = INTERNALS) -> TorchCheck:
    """Check every torch internal spotrun relies on, at start. On a torch outside :data:`TESTED_TORCH`, log
    once (WARNING) which internals were checked and that they passed.

    Returns:
        The check, all passed.

    Raises:
        TorchInternalsError: an internal failed its check; the message names each one, what differs, and the
            releases known to work.
    """
    result = check_torch(version, internals)
    if result.failed:
        details = "; ".join(f"{name}: {detail}" for name, detail in result.failed.items())
        raise TorchInternalsError(
            f"spotrun cannot run on torch {result.torch_version}: {len(result.failed)} of the {len(result.checked)} "
            f"torch internals it relies on changed ({details}). spotrun is known to work with {known_to_work()} "
            f"(pip install 'torch>=2.13,<2.16'); elastic/torch_internals.py says what each internal is used for."
        )
    if not result.tested:
        logger.warning(
            "torch %s is outside the releases spotrun is tested with (%s): all %d runtime checks of the torch "
            "internals it relies on passed (%s); running", result.torch_version, known_to_work(),
            len(result.checked), ", ".join(result.checked))
    return result


@functools.cache
def verify_torch_once() -> TorchCheck:
    """:func:`verify_torch` on the first call of the process, its result afterwards (the launcher and the CLI
    both call it; the notice is said once)."""
    return verify_torch()


def require(condition: bool, internal: str, detail: str) -> None:
    """Raise :class:`TorchInternalsError` naming ``internal`` unless ``condition`` holds (a last guard where an
    internal is used; :func:`verify_torch` has checked them all at start)."""
    if not condition:
        raise TorchInternalsError(
            f"spotrun relies on the torch internal {internal}, but the installed torch {torch.__version__} "
            f"differs: {detail}. spotrun is known to work with {known_to_work()}; re-check the CHANGE: markers "
            "in elastic/agent.py against this torch release (elastic/torch_internals.py names the functions)."
        )


# --------------------------------------------------------------------------- guarded uses

AGENT_STATE: Final = ("_worker_group", "_remaining_restarts", "_pcontext")
"""Private attributes of torch's agent that ``SpotrunAgent`` reads or writes."""


def check_agent_internals(agent: object) -> None:
    """The private hooks and attributes of torch's agent that ``SpotrunAgent`` depends on all exist."""
    for internal in INTERNALS:
        if internal.path.startswith(f"{_AGENT}.") and not internal.path.endswith("__init__"):
            name = internal.path.rsplit(".", 1)[1]
            require(callable(getattr(agent, name, None)), f"SimpleElasticAgent.{name}", "the method is gone")
    for name in AGENT_STATE:
        require(hasattr(agent, name), f"SimpleElasticAgent.{name}", "the attribute is gone")


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


def entrypoint_name(entrypoint: Callable[..., Any] | str | None, args: list[Any]) -> str:
    """torchrun's name for the entrypoint in its failure summary (``launcher.api._get_entrypoint_name``)."""
    from torch.distributed.launcher.api import _get_entrypoint_name

    return _get_entrypoint_name(entrypoint, args)


def static_master_addr_and_port(rdzv_parameters: Any) -> tuple[str | None, int | None]:
    """The static backend's master address and port, (None, None) for other backends
    (``launcher.api._get_addr_and_port``)."""
    from torch.distributed.launcher.api import _get_addr_and_port

    return _get_addr_and_port(rdzv_parameters)


def privateuse1_backend_name() -> str:
    """The name torch's privateuse1 device backend is registered under (``torch._C``; no public getter)."""
    return str(torch._C._get_privateuse1_backend_name())


def current_fingerprints() -> dict[str, str | None]:
    """Every internal's source hash in the installed torch (None: no Python source)."""
    out: dict[str, str | None] = {}
    for internal in INTERNALS:
        try:
            out[internal.path] = source_hash(resolve(internal.path))
        except (ImportError, AttributeError, OSError, TypeError):
            out[internal.path] = None
    return out


if __name__ == "__main__":  # python -m elastic.torch_internals: the block to paste into FINGERPRINTS
    print(f"    \"{release_of(torch.__version__)}\": {{  # {torch.__version__}")
    for path, digest in current_fingerprints().items():
        if digest is not None:
            quoted = f'f"{{_AGENT}}{path[len(_AGENT):]}"' if path.startswith(_AGENT) else (
                f'f"{{_MP}}{path[len(_MP):]}"' if path.startswith(_MP) else f'"{path}"')
            print(f"        {quoted}: \"{digest}\",")
    print("    },")
