"""Elastic DDP training with async checkpoints: the job spotrun is built to keep alive.

A small MLP learns a fixed linear map on a deterministic synthetic dataset. The data position is one global
cursor (``elastic.data``: epoch, samples consumed, seed) committed with each checkpoint, so a restart at a
different world size resumes exactly where the last committed checkpoint left off: each rank takes its
contiguous share of the next global batch (``--global-batch`` is fixed, the per-rank share and the number of
accumulation micro-batches, at most ``--max-micro-batch`` samples each, follow the world size). Each rank
backpropagates its summed loss times ``world_size / global_batch``, so DDP's average is the global-batch mean
even when the shares are uneven (64 at 3 ranks: 22/21/21): a 2 -> 1 -> 3 worker run stays within 1e-5 of an
uninterrupted one. ``--deterministic`` makes it bit-identical instead (``elastic.deterministic``: fixed
``--shards`` virtual micro-batches, each computed alone, summed along a fixed tree over the shards; see
``bench/deterministic_bench.py`` for its cost).
Under spotrun the training runs in ``elastic.inplace.run``: when a peer node leaves with a notice or is lost,
this process stays, rebuilds its process group at the new size and trains on from the next step
(docs/concepts/reform-in-place.md); other changes restart it, and WORLD_SIZE/RANK/LOCAL_RANK are read at every
start. gloo on CPU, nccl when CUDA is available.

Run it (from the repository root):
    # single process, no launcher
    python examples/train_ddp.py --steps 50 --ckpt-dir runs/ckpt
    # one node, two workers, embedded etcd (what examples/run.sh does)
    spotrun --standalone --nproc-per-node 2 examples/train_ddp.py --steps 200 --ckpt-dir runs/ckpt
    # elastic batches: at most 16 samples per forward (accumulation), or bit-exact across world sizes
    spotrun --standalone --nproc-per-node 3 examples/train_ddp.py --steps 200 --ckpt-dir runs/ckpt --max-micro-batch 16
    spotrun --standalone --nproc-per-node 3 examples/train_ddp.py --steps 200 --ckpt-dir runs/det --deterministic
    # memory tier (on by default under spotrun: --memory-snapshot-every auto; --no-memory-tier turns it off):
    # snapshots in host shared memory, so a crashed worker resumes from the last completed step
    spotrun --standalone --nproc-per-node 2 --max-restarts 3 examples/train_ddp.py --steps 200 --ckpt-dir runs/ckpt \
        --memory-snapshot-every 1
    # several nodes (run on each node; 1 to 4 nodes, joins and losses handled at the next round)
    python -m elastic.etcd_server --host 0.0.0.0          # once, somewhere reachable (or a real etcd >= 3.5)
    spotrun --nnodes 1:4 --nproc-per-node 2 --rdzv-endpoint ETCD_HOST:PORT --rdzv-id job1 \\
        examples/train_ddp.py --steps 100000 --ckpt-dir s3://bucket/job1
    # S3 outside AWS (MinIO, Ceph, ...): needs `pip install spotrun[s3]`; AWS_ENDPOINT_URL works as well
    spotrun --standalone --nproc-per-node 2 examples/train_ddp.py --ckpt-dir s3://bucket/job1 \\
        --storage-option endpoint_url=http://127.0.0.1:9000
Every ``--log-every`` steps rank 0 prints ``step=N loss=X world_size=W`` (X: the global-batch mean loss).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from checkpoint.api import CheckpointError
from elastic import inplace
from elastic.data import BatchConfig, ElasticBatches, ElasticDataError, StepPlan
from elastic.deterministic import ShardGradReducer
from elastic.inplace import InPlaceConfig
from elastic.preemption import Preemption

logger = logging.getLogger("train_ddp")

FEATURES = 32


@dataclass(kw_only=True, slots=True)
class TrainerState:
    """Progress that is not in the model or optimizer; checkpointed as JSON."""

    step: int = 0
    """Optimizer steps completed."""
    samples_seen: int = 0
    """Global samples consumed: the data position, independent of the world size."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])


def synthetic_regression(size: int, seed: int) -> TensorDataset:
    """``y = x @ w_true + noise`` with a fixed seed: every rank builds the same dataset without I/O."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, FEATURES, generator=gen)
    w_true = torch.randn(FEATURES, 1, generator=gen)
    return TensorDataset(x, x @ w_true + 0.01 * torch.randn(size, 1, generator=gen))


def make_model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank (DDP also broadcasts rank 0's)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))


def storage_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value), the same rule as ``spotrun-ckpt --storage-option``."""
    # One parser for both CLIs, imported here: the checkpoint package is only needed when options are given.
    from checkpoint.cli import parse_option

    return parse_option(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="elastic DDP training with async checkpoints")
    p.add_argument("--steps", type=int, default=200, help="train until this many optimizer steps are done")
    p.add_argument("--global-batch", type=int, default=64, help="samples per step across all ranks")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint URI (local path or s3://...); none: no checkpoints")
    p.add_argument("--storage-option", "-o", action="append", default=[], type=storage_option, metavar="KEY=VALUE",
                   help="fsspec option for --ckpt-dir, repeatable, e.g. endpoint_url=http://127.0.0.1:9000 "
                        "(values parse as JSON when they are JSON: numbers, booleans, objects)")
    p.add_argument("--ckpt-every", type=int, default=50, help="save every N steps (and at the end)")
    p.add_argument("--ckpt-retry-timeout", type=float, default=60.0,
                   help="seconds a checkpoint storage operation retries transient errors (CheckpointConfig.retry_timeout)")
    p.add_argument("--log-every", type=int, default=20, help="rank 0 prints one line every N steps")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (to watch recoveries)")
    p.add_argument("--progress-file", default=None,
                   help="append one JSON line per step and rank (rank, world_size, step, pid, t_wall, loss): benchmarks")
    p.add_argument("--pg-timeout", type=float, default=120.0, help="process group (collective) timeout, seconds")
    p.add_argument("--preempt-sync-every", type=int, default=8,
                   help="steps between two checks (one tiny all-reduce) for a preemption notice or a joining node")
    p.add_argument("--max-micro-batch", type=int, default=None,
                   help="most samples a rank feeds forward at once (gradient accumulation); default: its whole share")
    p.add_argument("--loader-workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--deterministic", action="store_true",
                   help="bit-identical at any world size: --shards fixed micro-batches reduced in shard order")
    p.add_argument("--shards", type=int, default=8, help="virtual micro-batches per global batch (--deterministic)")
    p.add_argument("--memory-snapshot-every", type=snapshot_interval, default="auto", metavar="K",
                   help="snapshot the state into host shared memory every K steps (spotrun's memory tier; a restart "
                        "resumes from it before the durable checkpoint); 'auto' (default): every step while it costs "
                        "under 2%% of the step time, else the smallest K that does; 0: off. Off outside spotrun")
    p.add_argument("--no-memory-tier", dest="memory_snapshot_every", action="store_const", const=0,
                   help="turn the memory tier off (the same as --memory-snapshot-every 0)")
    args = p.parse_args(argv)
    if args.steps < 0 or args.global_batch < 1 or args.ckpt_every < 1 or args.log_every < 1:
        p.error("--steps must be >= 0 and --global-batch, --ckpt-every, --log-every >= 1")
    if args.storage_option and args.ckpt_dir is None:
        p.error("--storage-option configures the --ckpt-dir location; pass --ckpt-dir too")
    if args.loader_workers < 0:
        p.error("--loader-workers must be >= 0")
    if not args.ckpt_retry_timeout > 0:
        p.error("--ckpt-retry-timeout must be > 0 seconds")
    try:
        args.batch_config = BatchConfig(
            global_batch=args.global_batch,
            dataset_size=args.dataset_size,
            max_micro_batch=None if args.deterministic else args.max_micro_batch,
            seed=args.seed,
            num_shards=args.shards if args.deterministic else None,
        )
    except ElasticDataError as exc:
        p.error(str(exc))
    return args


def init_distributed(pg_timeout: float) -> tuple[int, int, torch.device]:
    """Join the process group if a launcher started us; returns (rank, world size, device)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if "MASTER_ADDR" in os.environ and world > 1:
        dist.init_process_group(backend, timeout=timedelta(seconds=pg_timeout))
    return rank, world, device


def open_checkpointer(uri: str | None, storage_options: dict[str, Any] | None = None,
                      retry_timeout: float = 60.0) -> Any:
    if uri is None:
        return None
    try:
        from checkpoint import CheckpointConfig, Checkpointer
    except ImportError as exc:
        raise SystemExit(f"--ckpt-dir needs the spotrun `checkpoint` package (Checkpointer), which failed to import: {exc}") from exc
    return Checkpointer(uri, CheckpointConfig(storage_options=storage_options or {},
                                              retry_timeout=timedelta(seconds=retry_timeout)))


def snapshot_interval(text: str) -> int | str:
    """``--memory-snapshot-every``: an integer >= 0 (0: off) or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0 or 'auto'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0 (0: off) or 'auto'")
    return value


def open_memory_tier(every: int | str, *, synchronous: bool = False) -> Any:
    """spotrun's memory tier (``checkpoint.memory``) snapshotting every ``every`` steps; None when 0. Off (said
    once) outside spotrun, which gives every worker its node's keeper directory. A node that replaces a lost one
    restores from the other nodes' memory (``PeerShmTier``); this model is replicated (DDP), so no buddy copies.
    ``synchronous``: each snapshot published and copied before the next step (``MemoryTierConfig.synchronous``)."""
    if not every:
        return None
    from checkpoint.memory import MemoryTierConfig, PeerShmTier

    return PeerShmTier(config=MemoryTierConfig(every=every, synchronous=synchronous))


def append_progress(path: str, record_: dict[str, Any]) -> None:
    """One O_APPEND write per line, so ranks and nodes can share the file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record_) + "\n").encode())
    finally:
        os.close(fd)


def train_step(model: nn.Module, ddp: nn.Module, plan: StepPlan, micro: Any, device: torch.device) -> torch.Tensor:
    """One step's gradients (normal mode): each micro-batch's summed loss times ``plan.loss_scale``, DDP
    syncing on the last one only. Returns this rank's summed loss."""
    loss_fn = nn.MSELoss(reduction="sum")
    loss_sum = torch.zeros((), device=device)
    for i in range(plan.accumulation_steps):
        x, y = next(micro)
        last = i == plan.accumulation_steps - 1
        with nullcontext() if last or ddp is model else ddp.no_sync():  # type: ignore[operator]  # ddp is DDP whenever no_sync() is reached
            loss = loss_fn(ddp(x.to(device)), y.to(device))
            (loss * plan.loss_scale).backward()
        loss_sum += loss.detach()
    return loss_sum


def global_mean_loss(loss_sum: torch.Tensor, global_batch: int) -> torch.Tensor:
    """The global-batch mean loss from each rank's summed loss (what rank 0 prints)."""
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    return loss_sum / global_batch


def deterministic_step(model: nn.Module, reducer: ShardGradReducer, plan: StepPlan, micro: Any,
                       device: torch.device) -> torch.Tensor:
    """One step's gradients in deterministic mode; returns the global-batch mean loss (bit-exact)."""
    loss_fn = nn.MSELoss(reduction="sum")
    reducer.begin()
    for shard in plan.shard_ids:
        x, y = next(micro)
        reducer.add_shard(shard, loss_fn(model(x.to(device)), y.to(device)))
    return reducer.finish()


@record
def main(argv: list[str] | None = None) -> None:
    """Train; a checkpoint error (a location that cannot be written, a final save that failed) ends the process
    with one line naming it and exit status 1, not a traceback (torchrun's summary still names the rank)."""
    args = parse_args(argv)
    try:
        train(args)
    except CheckpointError as exc:
        print(f"train_ddp.py: error: [rank {os.environ.get('RANK', '0')}] {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


@dataclass(kw_only=True, slots=True)
class Job:
    """What outlives a re-form in place: the model, the optimizer, the progress, the data (rank-independent)."""

    args: argparse.Namespace
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    trainer: TrainerState
    batches: ElasticBatches
    dataset: TensorDataset

    @property
    def state(self) -> dict[str, Any]:
        # Checkpoint the bare module: its keys do not depend on DDP or on the world size.
        return {"model": self.model, "optim": self.optimizer, "trainer": self.trainer, "data": self.batches}


def train(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    if args.deterministic:
        torch.set_num_threads(1)  # a GEMM may split its reduction by thread: fix the count, like the shards
    _, _, device = init_distributed(args.pg_timeout)
    model = make_model().to(device)
    job = Job(args=args, device=device, model=model,
              optimizer=torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), trainer=TrainerState(),
              batches=ElasticBatches(args.batch_config), dataset=synthetic_regression(args.dataset_size, args.seed))
    try:
        # Under spotrun a peer's planned leave or a lost peer re-enters train_group in this process with the new
        # group (elastic.inplace); elsewhere it runs once.
        inplace.run(train_group, job, config=InPlaceConfig(pg_timeout=timedelta(seconds=args.pg_timeout)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train_group(gen: inplace.Generation, job: Job) -> None:
    """Train with the current group until the end, a planned stop or a broken collective. Everything built on
    the group is tracked: the wrapper releases it before a re-form (DDP's reducer first of all, while the
    group still lives: freed after ``destroy_process_group``, its destructor can hang joining gloo's threads)."""
    args, trainer, batches, model, optimizer, device = job.args, job.trainer, job.batches, job.model, job.optimizer, job.device
    rank, world, state = gen.rank, gen.world_size, job.state
    ctx = f"[rank {rank}/{world} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}]"
    ckpt = gen.track(open_checkpointer(args.ckpt_dir, dict(args.storage_option), args.ckpt_retry_timeout))
    memory = gen.track(open_memory_tier(args.memory_snapshot_every))
    restored: dict[str, Any] = {}  # the restore's report (restore_source, restore_step...): on the first progress line
    if not gen.needs_restore:  # re-formed in place: the state in memory is every rank's last completed step
        restored = {"reformed_in_place": True}
        logger.info("%s re-formed in place at step %d", ctx, trainer.step)
    else:  # the first entry, or new workers joined the group: every rank restores (collective)
        step_restored: int | None = None
        if memory is not None:
            from checkpoint.memory import restore

            if (report := restore(ckpt, state, memory=memory)) is not None:
                step_restored, restored = report.step, report.to_json()
                logger.info("%s resumed from step %s (%s, samples_seen=%s)", ctx, report.step, report.source.value,
                            trainer.samples_seen)
        elif ckpt is not None and (step_restored := ckpt.load(state)) is not None:
            logger.info("%s resumed from step %s (samples_seen=%s)", ctx, step_restored, trainer.samples_seen)
        gen.restored(step_restored)  # survivors and new workers restored the same step, or all restart alike
        if gen.reformed:
            restored["reformed_in_place"] = True
    if ckpt is not None and trainer.step >= args.steps and rank == 0 and not gen.reformed:
        print(f"step {trainer.step} of {args.steps}: nothing to do, checkpoints in {args.ckpt_dir}", flush=True)
    # Deterministic mode replaces DDP's gradient reduction with the fixed-order shard sum.
    reducer = None
    if args.deterministic:
        reducer = ShardGradReducer(model.parameters(), num_shards=args.shards, global_batch=args.global_batch)
    ddp = gen.track(DistributedDataParallel(model)) if dist.is_initialized() and reducer is None else model
    # On a preemption notice (or a node joining) every rank stops at the same step, which is committed:
    # spotrun then re-forms the group (in place for a peer's leave) or the next start resumes there (SIGTERM
    # under plain torchrun).
    preemption: Preemption | None = None
    if ckpt is not None:
        preemption = gen.preemption(sync_every=args.preempt_sync_every)
    # The sampler starts at the cursor and yields this rank's micro-batches step after step.
    sampler = batches.sampler(rank, world, steps=max(0, args.steps - trainer.step))
    micro = iter(DataLoader(job.dataset, batch_sampler=sampler, num_workers=args.loader_workers))
    try:
        while trainer.step < args.steps:
            plan = batches.plan(rank, world)
            optimizer.zero_grad(set_to_none=True)
            if reducer is None:
                loss = global_mean_loss(train_step(model, ddp, plan, micro, device), args.global_batch)
            else:
                loss = deterministic_step(model, reducer, plan, micro, device)
            optimizer.step()
            batches.advance()
            trainer.step += 1
            trainer.samples_seen += args.global_batch
            gen.completed(trainer.step)
            if args.step_time:
                time.sleep(args.step_time)
            if args.progress_file:
                append_progress(args.progress_file, {"rank": rank, "world_size": world, "step": trainer.step,
                                                     "pid": os.getpid(), "t_wall": time.time(),
                                                     "loss": loss.item(), **restored})
                restored = {}
            if rank == 0 and (trainer.step % args.log_every == 0 or trainer.step == args.steps):
                print(f"step={trainer.step} loss={loss.item():.5f} world_size={world}", flush=True)
            if memory is not None:  # before a planned stop's save: a joiner restores the agreed step from memory
                memory.snapshot(trainer.step, state)  # acts every --memory-snapshot-every steps
            if preemption is not None and preemption.save_and_stop(ckpt, trainer.step, state):
                return  # the agreed step is committed: a peer's leave re-enters here at the new size
            if ckpt is not None and (trainer.step % args.ckpt_every == 0 or trainer.step == args.steps):
                ckpt.save(trainer.step, state)
        if ckpt is not None:
            ckpt.wait()
    except BaseException as exc:
        # A peer died mid-step: the collective raised before optimizer.step(), so the state is still that of
        # trainer.step. Snapshot it into memory (no collective; only for a failed collective): a re-form in
        # place goes on from it in memory, a restart restores it, losing no completed step even with
        # --memory-snapshot-every K > 1.
        if memory is not None:
            memory.snapshot_on_failure(trainer.step, state, exc)
        raise


if __name__ == "__main__":
    main()
