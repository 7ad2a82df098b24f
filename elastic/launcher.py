"""Run one spotrun agent for a torch ``LaunchConfig``: build the rendezvous handler, run, report failures.

This mirrors ``torch.distributed.launcher.api.launch_agent`` (torch 2.13 to 2.15: 2.15 only logs a failing
rendezvous shutdown instead of raising, as ``launch`` already did) step for step. We do not call it
directly because it constructs ``LocalElasticAgent`` itself, with no hook to substitute our agent class, and
because we convert rendezvous construction errors (unknown ``--rdzv-conf`` key, unreachable etcd) into
:class:`~elastic.api.RendezvousUnavailableError` / :class:`~elastic.api.LaunchConfigError` at this edge.
The result handling is torch's: a failed run raises ``ChildFailedError`` so ``@record`` on ``main`` prints
the same root-cause summary (read from the failed worker's error file) and the process exits 1 like torchrun.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import os
import re
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from torch.distributed.elastic import events as torch_events
from torch.distributed.elastic import metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousHandler, RendezvousParameters
from torch.distributed.launcher import api as torch_launcher
from torch.distributed.launcher.api import LaunchConfig

from checkpoint.memory.api import ENV_MEMORY_DIR
from elastic import early_notice
from elastic.agent import SpotrunAgent
from elastic.api import (
    DEFAULT_RDZV_BACKEND,
    ENV_NOTICE_DIR,
    EventSink,
    LaunchConfigError,
    PlannedLeaveExit,
    RendezvousUnavailableError,
)
from elastic.boot import discard as discard_early_forkserver
from elastic.boot import early_forkserver_started, forkserver_running
from elastic.config import AgentSettings
from elastic.events import EVENTS_FILE_NAME, JsonlEventLog
from elastic.membership import warn_one_line
from elastic.memory_keeper import Keeper
from elastic.metrics import AgentMetrics, MetricsServer, MetricsSink, serve
from elastic.notice import NoticePoller, make_sources, notice_signals
from elastic.progress import remove_orphaned_progress_files
from elastic.rendezvous.api import (
    ConnectableHandler,
    FinishMarkingHandler,
    LeaseHandler,
    MembershipAwareHandler,
    NamedNodeHandler,
    RendezvousFinishedError,
)
from elastic.rendezvous.registry import register
from elastic.torch_internals import entrypoint_name as torch_entrypoint_name
from elastic.torch_internals import static_master_addr_and_port, verify_torch_once
from elastic.warm import note_agent_import_env, note_agent_import_start, note_forkserver_failure
from elastic.worker.mailbox import Mailbox
from elastic.workers import start_warm_forkserver, warm_entrypoint

logger = logging.getLogger(__name__)

_COMPILER_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_", "TRITON_")


def register_backends() -> None:
    """Register the etcd-v3 backend in torch's handler registry (idempotent)."""
    register()


def create_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the handler, turning the backend's many error types into spotrun's error tree."""
    if params.backend == DEFAULT_RDZV_BACKEND:
        register_backends()
        if not params.endpoint:
            raise LaunchConfigError(
                "--rdzv-backend etcd-v3 needs --rdzv-endpoint HOST:PORT of an etcd v3 server "
                "(or use --standalone to start an embedded etcd)"
            )
    try:
        return rdzv_registry.get_rendezvous_handler(params)
    except (ValueError, KeyError, TypeError) as exc:
        raise LaunchConfigError(f"invalid rendezvous configuration for backend {params.backend!r}: {exc}") from exc
    except Exception as exc:
        raise RendezvousUnavailableError(
            f"cannot set up rendezvous backend {params.backend!r} at {params.endpoint!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


HELPER_IMPORT = re.compile(rb"\belastic(?:\.worker)?\.preemption\b|\bfrom\s+elastic(?:\.worker)?\s+import\s[^\n]*\bpreemption\b")
"""An import of the preemption helper's module in a script's source."""
MAX_SCRIPT_BYTES = 4 << 20
"""Most bytes of a training script read to look for the helper's import (a script is a few KB)."""


def imports_helper(entrypoint: Callable[..., Any] | str, args: Sequence[Any]) -> bool:
    """Whether a ``python -u script.py ...`` launch's script imports ``elastic.preemption`` in its own source.

    A hint for the notice that arrives while the workers start (``planned.HelperOutlook``): before they
    build their helpers, workers of such a script have trained nothing since their restore. A script that
    imports the helper through a module of its own is seen at run time instead (``coming-{local_rank}``). A
    module (``-m``), a function or a binary, or a script that cannot be read: False."""
    if not isinstance(entrypoint, str) or len(args) < 2 or str(args[0]) != "-u" or str(args[1]) == "-m":
        return False
    try:
        with open(str(args[1]), "rb") as handle:
            source = handle.read(MAX_SCRIPT_BYTES)
    except OSError:
        return False
    return HELPER_IMPORT.search(source) is not None


def replaced_torch_agent() -> object | None:
    """What torch's launcher builds instead of its ``LocalElasticAgent`` when a caller replaced the class in
    ``torch.distributed.launcher.api`` (a framework's own agent, a test double); None when it is torch's own."""
    agent: object = torch_launcher.LocalElasticAgent
    return None if agent is LocalElasticAgent else agent


def _maybe_warm(
    config: LaunchConfig, entrypoint: Callable[..., Any] | str, args: list[Any], settings: AgentSettings
) -> tuple[Callable[..., Any] | str, list[Any]]:
    """Switch a ``python -u script`` launch to warm workers (forkserver with torch preloaded) when enabled."""
    if not settings.warm_workers:
        return entrypoint, args
    if forkserver_running() and not early_forkserver_started():
        # This process already has a forkserver (a caller of main(argv) that uses one): it was started with
        # neither spotrun's preloads nor its environment, and multiprocessing keeps one per process.
        logger.info("warm workers off: this process already runs a forkserver of its own; plain workers like torchrun")
        return entrypoint, args
    warm = warm_entrypoint(entrypoint, [str(a) for a in args])
    if warm is None:
        return entrypoint, args
    script = warm[0]
    if not script.module and not os.path.isfile(script.target):
        # A missing script: start no forkserver (seconds of `import torch`) for a worker that cannot run;
        # the cold `python -u script` fails at once with torchrun's own "can't open file" message.
        return entrypoint, args
    config.start_method = "forkserver"
    return warm


#: Seconds past the lease TTL before a dead peer is surely seen gone: etcd expires leases on a 0.5 s tick,
#: the deletion then travels through the watch, and a loaded machine adds its own delay.
LEASE_EXPIRY_MARGIN = 2.0


def peer_loss_window(grace: float, lease_ttl: float | None) -> float:
    """Seconds a failed group with no restarts left watches the membership for a lost peer before giving up.

    A SIGKILLed peer breaks the survivors' collectives at once (its sockets close), but its lease lasts up
    to ``lease_ttl``: a shorter wait would charge the loss to the survivor as its own failure and end the
    job. So the wait covers the lease TTL plus a margin; ``grace`` 0 keeps it off."""
    if grace <= 0 or lease_ttl is None:
        return grace
    return max(grace, lease_ttl + LEASE_EXPIRY_MARGIN)


def _effective_settings(config: LaunchConfig, settings: AgentSettings, lease_ttl: float | None) -> AgentSettings:
    """A job of one node has no peer whose loss could explain a worker failure: waiting
    ``peer_loss_grace`` for one only delays the failure (torchrun reports it at once). Otherwise the
    wait covers the peers' lease TTL (:func:`peer_loss_window`)."""
    if config.max_nodes == 1 and settings.peer_loss_grace > 0:
        return dataclasses.replace(settings, peer_loss_grace=0.0)
    window = peer_loss_window(settings.peer_loss_grace, lease_ttl)
    if window != settings.peer_loss_grace:
        return dataclasses.replace(settings, peer_loss_grace=window)
    return settings


def lease_ttl_of(handler: RendezvousHandler) -> float | None:
    """How long a dead peer stays a member (etcd-v3's lease TTL); None for backends without leases.

    A runtime-checkable protocol only checks that the attribute exists (any ``Mock`` has it): the value must be
    a positive, finite number of seconds, else the handler counts as one without leases."""
    if not isinstance(handler, LeaseHandler):
        return None
    ttl = handler.lease_ttl
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
        logger.debug("rendezvous handler %s has no usable lease_ttl (%r): no lease wait", type(handler).__name__, ttl)
        return None
    return float(ttl)


def _preimport_log_formatter_dependencies() -> None:
    """torch's log formatter (``TorchLogsFormatter``) imports ``torch._dynamo`` the first time it formats a
    record with an exception, and torch logs a worker failure with ``logger.exception``: the first worker
    crash would cost the agent that import (seconds, see docs/benchmarks.md) before it even starts recovering. Import it
    in a daemon thread while the first rendezvous and worker start are under way. What the import writes into
    the agent's environment (``TORCHINDUCTOR_CACHE_DIR``) is undone: torchrun's workers never see it."""

    before = dict(os.environ)
    note_agent_import_start(before, _COMPILER_ENV_PREFIXES)  # workers started meanwhile do not get them (warm.py)

    def preimport() -> None:
        try:
            importlib.import_module("torch._dynamo")
        except Exception:  # only an optimisation
            logger.debug("pre-importing torch._dynamo failed", exc_info=True)
        # Only the compiler stack's own variables: the main thread may set others meanwhile.
        added = {name for name in set(os.environ) - set(before) if name.startswith(_COMPILER_ENV_PREFIXES)}
        note_agent_import_env(added)
        for name in added:
            os.environ.pop(name, None)

    threading.Thread(target=preimport, name="spotrun-preimport", daemon=True).start()


def _leave_rendezvous(handler: RendezvousHandler) -> None:
    """On SIGTERM/SIGINT (e.g. spot preemption) give up this node's membership at once when the backend can
    (etcd-v3 ``leave()`` revokes the lease), so peers re-form now instead of after the lease TTL. Unlike
    ``shutdown()`` this does not close the job for the other nodes."""
    if not isinstance(handler, MembershipAwareHandler):
        return  # torch's backends have no way to leave; peers notice when this node's heartbeat stops
    try:
        handler.leave()
    except RendezvousError as exc:
        warn_one_line(logger, exc, "leaving the rendezvous failed (%s); peers will notice when the lease expires",
                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _mark_finished(handler: RendezvousHandler) -> None:
    """The run finished successfully: let the backend keep a marker for agents started for it later (etcd-v3
    ``finished_ttl``). A failure costs only that: the run did finish."""
    if not isinstance(handler, FinishMarkingHandler):
        return
    try:
        handler.mark_finished()
    except RendezvousError as exc:
        warn_one_line(logger, exc, "could not leave the run's finished marker (an agent started for this run now "
                      "waits for peers): %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _with_metrics(event_log: JsonlEventLog, port: int | None
                  ) -> tuple[EventSink, AgentMetrics | None, MetricsServer | None]:
    """The agent's event sink, its metrics and their exporter: the log itself and no metrics, or
    (``--metrics-port``) the log wrapped by the metrics that are derived from its events, the metrics (the
    progress watch, ``elastic.vitals``, sets the rest) and their exporter, started."""
    if port is None:
        return event_log, None, None
    agent_metrics = AgentMetrics()
    try:
        exporter = serve(agent_metrics, port)
    except OSError as exc:
        raise LaunchConfigError(f"--metrics-port {port}: cannot listen there ({exc}); pick a free port") from exc
    return MetricsSink(event_log, agent_metrics), agent_metrics, exporter


def _restore_env(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def events_path(config: LaunchConfig, settings: AgentSettings) -> str:
    """``--events-file``, else ``<log root>/events.jsonl`` (``--log-dir`` or torch's temp log dir)."""
    if settings.events_file:
        return settings.events_file
    root = config.logs_specs.root_log_dir if config.logs_specs is not None else None
    return os.path.join(root or ".", EVENTS_FILE_NAME)


def launch(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: list[Any],
    settings: AgentSettings,
) -> dict[int, Any]:
    """Run the agent until the job succeeds (returns rank -> return value) or fails (``ChildFailedError``)."""
    verify_torch_once()  # the torch internals spotrun relies on: fail here, not mid-run
    if (replaced := replaced_torch_agent()) is not None:
        # CHANGE (drop-in): the caller swapped torch's agent class for its own, and torchrun would run that one:
        # so does spotrun, through torch's own launch (spotrun's agent, and what it adds, sit this launch out).
        logger.warning("torch's LocalElasticAgent is replaced by %r here: running torch's launch_agent with it, "
                       "as torchrun would (without spotrun's agent)", replaced)
        return torch_launcher.launch_agent(config, entrypoint, args)
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
        logger.warning("config has no run_id, generated a random run_id: %s", config.run_id)
    entrypoint_name = torch_entrypoint_name(entrypoint, args)
    script_imports_helper = imports_helper(entrypoint, args)
    entrypoint, args = _maybe_warm(config, entrypoint, args, settings)
    if config.start_method != "forkserver":
        discard_early_forkserver()  # elastic.boot guessed warm workers; the launcher decided otherwise

    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = static_master_addr_and_port(rdzv_parameters)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    rdzv_handler = create_rendezvous_handler(rdzv_parameters)
    settings = _effective_settings(config, settings, lease_ttl_of(rdzv_handler))

    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    # The node id the rendezvous registered (``spotrun status`` lists it) names this agent in its events too.
    node = rdzv_handler.node_id if isinstance(rdzv_handler, NamedNodeHandler) else None
    event_log = JsonlEventLog(events_path(config, settings), run_id=config.run_id, node=node)
    logger.info(
        "spotrun agent: run_id=%s backend=%s endpoint=%s nnodes=%s:%s nproc_per_node=%s events=%s",
        config.run_id, config.rdzv_backend, config.rdzv_endpoint, config.min_nodes, config.max_nodes,
        config.nproc_per_node, event_log.path,
    )
    # What the agent holds outside its own objects (a port, a thread, files, the keeper process) is released
    # in reverse order of setup, also when a later step of the setup fails.
    cleanup = contextlib.ExitStack()
    try:
        events, agent_metrics, exporter = _with_metrics(event_log, settings.metrics_port)
        if exporter is not None:
            cleanup.callback(exporter.close)
        # The workers' mailbox (elastic.preemption): set before the forkserver starts, warm workers inherit it.
        shielded = notice_signals(settings.preempt_signal)
        mailbox = Mailbox.create(notice_signals=shielded)
        cleanup.callback(mailbox.remove)
        remove_orphaned_progress_files()  # hang detection's files of agents killed on this host (as the mailboxes)
        # Both variables name this launch's directories, removed at its end: put back what a caller of
        # main(argv) had, so nothing it starts afterwards finds them.
        cleanup.callback(_restore_env, {name: os.environ.get(name) for name in (ENV_NOTICE_DIR, ENV_MEMORY_DIR)})
        os.environ[ENV_NOTICE_DIR] = mailbox.path
        # The memory tier's shared memory on this node (elastic.memory_keeper): removed at exit, or by the
        # keeper process when this agent dies; orphans of agents killed with their keeper are swept here first.
        keeper = Keeper.create(config.run_id)
        cleanup.callback(keeper.close)
        os.environ[ENV_MEMORY_DIR] = keeper.path
        # LaunchConfig.__post_init__ fills both in (DefaultLogsSpecs; $TORCHELASTIC_SHUTDOWN_TIMEOUT or 30 s).
        assert config.logs_specs is not None and config.shutdown_timeout is not None
        agent = SpotrunAgent(
            spec,
            config.logs_specs,
            settings=settings,
            events=events,
            start_method=config.start_method,
            log_line_prefix_template=config.log_line_prefix_template,
            shutdown_timeout=config.shutdown_timeout,
            mailbox=mailbox,
            memory_dir=keeper.path,
            script_imports_helper=script_imports_helper,
            metrics=agent_metrics,
        )
        cleanup.callback(agent.release)
        poller = NoticePoller(make_sources(settings.preempt_sources, settings.preempt_grace), agent.receive_notice,
                              interval=settings.preempt_poll_interval).start()
        cleanup.callback(poller.stop)
    except BaseException:
        cleanup.close()
        raise

    shutdown_rdzv = True
    try:
        # An unreachable backend fails within its own timeout, not after seconds of imports below.
        if isinstance(rdzv_handler, ConnectableHandler):
            rdzv_handler.connect()
        _preimport_log_formatter_dependencies()
        if config.start_method == "forkserver":
            # After every env change the workers must inherit (OMP_NUM_THREADS, TORCHELASTIC_SIGNALS_TO_HANDLE)
            # and before joining the rendezvous: a joining node must not stall a running group on its imports.
            # The forkserver is the agent's: a notice signal sent to every process of the job step (Slurm)
            # must not end it (its children's exit codes would all read 255, and no restart could fork).
            try:
                logger.info("warm workers: forkserver ready in %.2f s", start_warm_forkserver(shielded=shielded))
            except OSError as exc:
                # A faster mode that cannot start is no reason to fail a job torchrun would run: its Unix socket
                # lives under TMPDIR, and a long TMPDIR makes that path too long (108 bytes). The agent then
                # starts plain workers and says so once, naming this (warm.warm_fallback_reason).
                note_forkserver_failure(f"{exc}; TMPDIR={tempfile.gettempdir()}")
        agent.install_notice_handlers()
        if (early := early_notice.take()) is not None:
            agent.receive_early_notice(early.signum, early.received_at)  # it arrived during the start-up above
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        torch_events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            # @record on main() copies the root-cause worker's error file into the launcher's, like torchrun.
            raise ChildFailedError(name=entrypoint_name, failures=result.failures)
        if agent.exit_status:
            raise PlannedLeaveExit(agent.exit_status, run_id=config.run_id)
        if agent.finished:
            _mark_finished(rdzv_handler)
        return result.return_values
    except (ChildFailedError, PlannedLeaveExit):
        raise
    except RendezvousFinishedError as exc:
        # CHANGE: an agent started for a run that already finished (a pod recreated after its Indexed Job's
        # run ended; etcd-v3 finished_ttl) succeeds at once instead of waiting join_timeout for peers.
        logger.warning("%s", exc)
        shutdown_rdzv = False  # the run is over: nothing of it to close, this node never registered
        _leave_rendezvous(rdzv_handler)
        return {}
    except RendezvousError as exc:
        # e.g. etcd unreachable or join timeout: a clear one-line error at the CLI edge, not a traceback.
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        raise RendezvousUnavailableError(f"rendezvous failed: {exc}") from exc
    except SignalException:
        # As torch: a signalled agent must not close the rendezvous, other nodes may still scale.
        shutdown_rdzv = False
        _leave_rendezvous(spec.rdzv_handler)
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        cleanup.close()  # the poller, the agent's files, the keeper, the mailbox, the metrics exporter
        if shutdown_rdzv:
            try:
                spec.rdzv_handler.shutdown()
            except Exception:  # shutting down a dead backend must not mask the real error
                logger.warning("rendezvous shutdown failed", exc_info=True)
