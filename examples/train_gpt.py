"""A small GPT-style language model trained elastically: DDP or FSDP2, async checkpoints, preemption-safe.

A character-level decoder-only transformer (``--layers`` 2, ``--d-model`` 64, ``--context`` 64 by default:
CPU-friendly) learns a deterministic synthetic corpus generated in this script from ``--seed`` (sentences
from a small fixed grammar: no download, identical on every rank and every restart). The data position is
the elastic global cursor (``elastic.data``): the global batch is fixed and each rank takes its share of it
at whatever world size the job has now; each rank backpropagates its summed per-sample loss times
``world_size / global_batch``, so DDP's and FSDP2's gradient averaging gives the global-batch mean even for
uneven shares. A preemption notice (or a node joining) stops every rank at the same step, which is
committed first (``elastic.preemption``), so spotrun re-forms the group without losing a step.

``--parallel ddp`` (default) replicates the model; ``--parallel fsdp`` shards every block and the whole
model with FSDP2 (``fully_shard``); the spotrun ``Checkpointer`` saves either as world-size-independent
tensors, so a DDP checkpoint resumes under FSDP2 and at any world size. ``--ckpt-backend dcp`` saves with
stock ``torch.distributed.checkpoint`` instead (synchronous ``dcp.save`` every ``--ckpt-every`` steps, no
preemption helper): the anchor of ``bench/goodput_bench.py``. Under spotrun with its checkpointer the memory
tier is on by default (``--memory-snapshot-every auto``; ``--no-memory-tier`` turns it off): snapshots in host
shared memory, buddy copies of FSDP2 shards on another node, so a crash or a lost node resumes from the last
completed step. Under spotrun the training runs in ``elastic.inplace.run``: when a peer node leaves with a
notice or is lost, this process stays and trains on with the new group (DDP: the model and optimizer as they are
in memory; FSDP2: sharded again on the new mesh and restored from the memory tier at the new world size, the
restore path of a restarted worker); docs/concepts/reform-in-place.md.

Run it (from the repository root):
    # single process, no launcher
    python examples/train_gpt.py --steps 50 --ckpt-dir runs/gpt
    # one node, two workers, embedded etcd; FSDP2 instead of DDP
    spotrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 300 --ckpt-dir runs/gpt
    spotrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 300 --ckpt-dir runs/gpt-fsdp --parallel fsdp
    # several nodes (run on each node; 1 to 4 nodes; a preempted node's step is saved before it leaves)
    python -m elastic.etcd_server --host 0.0.0.0          # once, somewhere reachable (or a real etcd >= 3.5)
    spotrun --nnodes 1:4 --nproc-per-node 2 --rdzv-endpoint ETCD_HOST:PORT --rdzv-id gpt1 \\
        examples/train_gpt.py --steps 100000 --ckpt-dir s3://bucket/gpt1 --parallel fsdp
    # the stock anchor: torchrun + DCP checkpoints
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 300 --ckpt-dir runs/gpt-dcp --ckpt-backend dcp
Every ``--log-every`` steps rank 0 prints ``step=N loss=X world_size=W`` (X: the global-batch mean loss, nats
per character); ``--progress-file`` lines are the same as ``examples/train_ddp.py``'s
(rank, world_size, step, pid, t_wall, loss; with the memory tier also memory_every, the snapshot interval in
use, memory_bytes, the shared memory this rank's snapshots hold, and memory_stage_ms, how long its last snapshot
blocked the step). Copy it with ``train_ddp.py``: it imports that file's launcher
and checkpoint helpers (``init_distributed``, ``open_checkpointer``, ``append_progress``).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

# The launcher and checkpoint plumbing is train_ddp.py's (same directory, on sys.path as the script's own).
from train_ddp import (
    append_progress,
    global_mean_loss,
    init_distributed,
    open_checkpointer,
    open_memory_tier,
    snapshot_interval,
    storage_option,
)

from checkpoint.api import CheckpointError
from elastic import inplace
from elastic.data import BatchConfig, ElasticBatches, ElasticDataError, StepPlan
from elastic.inplace import InPlaceConfig
from elastic.preemption import Preemption

logger = logging.getLogger("train_gpt")

# --------------------------------------------------------------------------- corpus

_SUBJECTS = ("the cat", "a dog", "my friend", "the old sailor", "every child", "the spot node", "a tired worker")
_VERBS = ("sees", "likes", "follows", "checkpoints", "remembers", "writes to", "waits for")
_OBJECTS = ("the moon", "a red ball", "the quiet sea", "its shadow", "the next step", "a long story", "the etcd lease")
_ENDINGS = (".", "!", " today.", " again.", " at night.", ", slowly.")


def make_corpus(chars: int, seed: int) -> str:
    """A deterministic text of ``chars`` characters: sentences of a tiny grammar drawn with ``seed``.

    Learnable structure (words, agreement of the grammar) at a few KB, so a 2-layer model's loss visibly falls
    within a few hundred CPU steps."""
    # Python's generator, not torch's: every new worker builds the corpus before its first step, and ~1700
    # one-element torch.randint calls cost ~10 ms of that (~1 ms here). Indexing by random() (whose stream
    # Python guarantees across versions, unlike choice()) keeps nodes on different Pythons on one corpus.
    rng = random.Random(seed)

    def pick(options: tuple[str, ...]) -> str:
        return options[int(rng.random() * len(options))]

    parts: list[str] = []
    size = 0
    while size < chars:
        sentence = f"{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)}{pick(_ENDINGS)}\n"
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:chars]


class CharWindows(Dataset):
    """Windows of ``context + 1`` characters every ``stride`` characters: (input ids, next-character ids)."""

    def __init__(self, text: str, context: int, stride: int) -> None:
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.context = context
        self.stride = stride
        self.count = (len(self.ids) - context - 1) // stride + 1
        if self.count < 1:
            raise ValueError(f"corpus of {len(text)} characters is shorter than one window of {context + 1}")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        window = self.ids[start:start + self.context + 1]
        return window[:-1], window[1:]


# --------------------------------------------------------------------------- model


@dataclass(frozen=True, slots=True)
class GPTConfig:
    vocab: int
    context: int
    d_model: int
    layers: int
    heads: int

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"--d-model {self.d_model} must be a multiple of --heads {self.heads}")


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        # Not tied to ``tok``: a shared parameter would need the same FSDP2 unit for both uses.
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_model(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)  # identical initial weights on every rank (DDP broadcasts rank 0's anyway)
    return GPT(cfg)


def parallelize(model: GPT, kind: str, device: torch.device) -> nn.Module:
    """The module the loop calls: DDP around ``model``, or ``model`` itself sharded in place by FSDP2."""
    if not dist.is_initialized():
        return model
    if kind == "ddp":
        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# --------------------------------------------------------------------------- training


@dataclass(kw_only=True, slots=True)
class TrainerState:
    """Progress that is not in the model or optimizer; checkpointed as JSON."""

    step: int = 0
    """Optimizer steps completed."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def sample_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed over the micro-batch of each sample's mean next-character loss (the elastic scaling needs sums)."""
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return per_token / targets.shape[1]


def train_step(model: nn.Module, wrapped: nn.Module, kind: str, plan: StepPlan, micro: Any,
               device: torch.device) -> torch.Tensor:
    """One step's gradients: each micro-batch's summed loss times ``plan.loss_scale``, gradients synchronised
    on the last micro-batch only. Returns this rank's summed loss."""
    loss_sum = torch.zeros((), device=device)
    for i in range(plan.accumulation_steps):
        x, y = next(micro)
        last = i == plan.accumulation_steps - 1
        sync: Any = nullcontext()
        if wrapped is not model and kind == "ddp" and not last:
            sync = wrapped.no_sync()  # type: ignore[operator]
        elif wrapped is model and kind == "fsdp" and dist.is_initialized():
            model.set_requires_gradient_sync(last)  # type: ignore[operator]
        with sync:
            loss = sample_losses(wrapped(x.to(device)), y.to(device))
            (loss * plan.loss_scale).backward()
        loss_sum += loss.detach()
    return loss_sum


# --------------------------------------------------------------------------- checkpoints


class DCPCheckpoints:
    """The stock anchor: ``torch.distributed.checkpoint.save`` of step directories, synchronously, and a load of
    the newest complete one (DCP writes ``.metadata`` last: a directory without it was interrupted)."""

    def __init__(self, root: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.root = root
        self.model = model
        self.optimizer = optimizer
        os.makedirs(root, exist_ok=True)

    def _state(self, extra: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, **{k: v.state_dict() for k, v in extra.items()}}

    def save(self, step: int, extra: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(extra), checkpoint_id=os.path.join(self.root, f"step_{step:08d}"))

    def latest(self) -> str | None:
        steps = [d for d in os.listdir(self.root) if re.fullmatch(r"step_\d{8}", d)
                 and os.path.exists(os.path.join(self.root, d, ".metadata"))]
        return os.path.join(self.root, max(steps)) if steps else None

    def load(self, extra: dict[str, Any]) -> str | None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = self.latest()
        if path is None:
            return None
        state = self._state(extra)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for key, value in extra.items():
            value.load_state_dict(state[key])
        return path


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="elastic GPT-style language model (DDP or FSDP2) with async checkpoints")
    p.add_argument("--steps", type=int, default=300, help="train until this many optimizer steps are done")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step across all ranks")
    p.add_argument("--max-micro-batch", type=int, default=None,
                   help="most sequences a rank feeds forward at once (gradient accumulation); default: its whole share")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234, help="corpus and data-order seed")
    p.add_argument("--corpus-chars", type=int, default=65536, help="size of the generated corpus")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp", help="replicate (DDP) or shard (FSDP2)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint URI (local path or s3://...); none: no checkpoints")
    p.add_argument("--storage-option", "-o", action="append", default=[], type=storage_option, metavar="KEY=VALUE",
                   help="fsspec option for --ckpt-dir, repeatable, e.g. endpoint_url=http://127.0.0.1:9000")
    p.add_argument("--ckpt-backend", choices=("spotrun", "dcp"), default="spotrun",
                   help="spotrun: async Checkpointer + preemption helper; dcp: stock torch.distributed.checkpoint")
    p.add_argument("--ckpt-every", type=int, default=50, help="save every N steps (and at the end)")
    p.add_argument("--log-every", type=int, default=20, help="rank 0 prints one line every N steps")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (to watch recoveries)")
    p.add_argument("--progress-file", default=None,
                   help="append one JSON line per step and rank (rank, world_size, step, pid, t_wall, loss): benchmarks")
    p.add_argument("--pg-timeout", type=float, default=120.0, help="process group (collective) timeout, seconds")
    p.add_argument("--loader-workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--memory-snapshot-every", type=snapshot_interval, default=None, metavar="K",
                   help="snapshot the state into host shared memory every K steps (spotrun's memory tier; a restart "
                        "after a crash or a lost node resumes from memory; with the spotrun checkpointer only); 'auto' picks "
                        "K; 0: off. Default: auto with --ckpt-backend spotrun, off with dcp. Off outside spotrun")
    p.add_argument("--no-memory-tier", dest="memory_snapshot_every", action="store_const", const=0,
                   help="turn the memory tier off (the same as --memory-snapshot-every 0)")
    p.add_argument("--memory-sync", action="store_true",
                   help="each memory snapshot published and its FSDP2 shards copied to their buddy node before the "
                        "next step (slower steps; with --memory-snapshot-every 1 a lost node redoes no step)")
    p.add_argument("--preempt-sync-every", type=int, default=8,
                   help="steps between two checks (one tiny all-reduce) for a preemption notice or a joining node")
    args = p.parse_args(argv)
    if args.steps < 0 or args.global_batch < 1 or args.ckpt_every < 1 or args.log_every < 1:
        p.error("--steps must be >= 0 and --global-batch, --ckpt-every, --log-every >= 1")
    if min(args.context, args.d_model, args.layers, args.heads, args.corpus_chars) < 1 or args.loader_workers < 0:
        p.error("--context, --d-model, --layers, --heads, --corpus-chars must be >= 1 and --loader-workers >= 0")
    if args.preempt_sync_every < 1:
        p.error("--preempt-sync-every must be >= 1")
    if args.memory_snapshot_every is None:
        args.memory_snapshot_every = 0 if args.ckpt_backend == "dcp" else "auto"
    elif args.memory_snapshot_every and args.ckpt_backend == "dcp":
        p.error("--memory-snapshot-every needs --ckpt-backend spotrun")
    if args.storage_option and (args.ckpt_dir is None or args.ckpt_backend == "dcp"):
        p.error("--storage-option configures the --ckpt-dir location of the spotrun Checkpointer; pass --ckpt-dir too")
    try:
        args.dataset = CharWindows(make_corpus(args.corpus_chars, args.seed), args.context, max(1, args.context // 2))
        args.gpt = GPTConfig(vocab=len(args.dataset.vocab), context=args.context, d_model=args.d_model,
                             layers=args.layers, heads=args.heads)
        args.batch_config = BatchConfig(global_batch=args.global_batch, dataset_size=len(args.dataset),
                                        max_micro_batch=args.max_micro_batch, seed=args.seed)
    except (ValueError, ElasticDataError) as exc:
        p.error(str(exc))
    return args


def memory_fields(memory: Any) -> dict[str, float]:
    """Progress fields of the memory tier (bench/memtier_bench.py): the snapshot interval in use, the host
    shared memory this rank's snapshot slots hold and the milliseconds its last snapshot blocked the step (what
    ``every="auto"`` weighs); none without the tier."""
    if memory is None or not memory.enabled:
        return {}
    return {"memory_every": memory.interval, "memory_bytes": memory.nbytes,
            "memory_stage_ms": round(1e3 * memory.last_stage_seconds, 3)}


@record
def main(argv: list[str] | None = None) -> None:
    """Train; a checkpoint error (a location that cannot be written, a final save that failed) ends the process
    with one line naming it and exit status 1, not a traceback (torchrun's summary still names the rank)."""
    args = parse_args(argv)
    try:
        train(args)
    except CheckpointError as exc:
        print(f"train_gpt.py: error: [rank {os.environ.get('RANK', '0')}] {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


@dataclass(kw_only=True, slots=True)
class Job:
    """What outlives a re-form in place: the model and optimizer (DDP: kept as they are; FSDP2: rebuilt at the new
    mesh and restored), the progress and the data cursor."""

    args: argparse.Namespace
    device: torch.device
    model: GPT
    optimizer: torch.optim.Optimizer | None = None
    trainer: TrainerState
    batches: ElasticBatches

    @property
    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optimizer, "trainer": self.trainer, "data": self.batches}


def train(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    _, _, device = init_distributed(args.pg_timeout)
    job = Job(args=args, device=device, model=make_model(args.gpt).to(device), trainer=TrainerState(),
              batches=ElasticBatches(args.batch_config))
    try:
        # Under spotrun a peer's planned leave or a lost peer re-enters train_group in this process with the new
        # group (elastic.inplace); elsewhere it runs once.
        # FSDP2 restores its new shards from the spotrun checkpointer (or its memory tier): without one, restarts.
        can = args.parallel == "ddp" or (args.ckpt_dir is not None and args.ckpt_backend == "spotrun")
        inplace.run(train_group, job, config=InPlaceConfig(enabled=can, pg_timeout=timedelta(seconds=args.pg_timeout)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train_group(gen: inplace.Generation, job: Job) -> None:
    """Train with the current group until the end, a planned stop or a broken collective (see train_ddp.py's
    ``train_group``). DDP keeps the model and optimizer in memory across a re-form in place; FSDP2's shards are
    laid out for the old mesh, so a re-formed FSDP2 entry builds the model again, shards it on the new mesh and
    restores the state from the memory tier at the new world size (the restore path of a restarted worker)."""
    args, trainer, batches, device = job.args, job.trainer, job.batches, job.device
    rank, world = gen.rank, gen.world_size
    ctx = f"[rank {rank}/{world} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}]"
    # New workers in the group (a join) or survivors at different steps: every rank restores (collective). FSDP2
    # restores at every re-form: its shards are laid out for the old mesh.
    needs_restore = gen.needs_restore
    reshard = gen.reformed and args.parallel == "fsdp"
    if reshard:
        job.model = make_model(args.gpt).to(device)
    model = job.model
    # FSDP2 shards the parameters in place, so the optimizer is built on the wrapped (sharded) parameters.
    wrapped = gen.track(parallelize(model, args.parallel, device))
    if job.optimizer is None or reshard:
        job.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    optimizer = job.optimizer
    state = job.state
    ckpt: Any = None
    dcp_ckpt: DCPCheckpoints | None = None
    dcp_step: int | None = None
    if args.ckpt_dir is not None and args.ckpt_backend == "dcp":
        dcp_ckpt = DCPCheckpoints(args.ckpt_dir, model, optimizer)
        if needs_restore and (path := dcp_ckpt.load({"trainer": trainer, "data": batches})) is not None:
            dcp_step = trainer.step
            logger.info("%s resumed from %s (step %s)", ctx, path, trainer.step)
    else:
        ckpt = gen.track(open_checkpointer(args.ckpt_dir, dict(args.storage_option)))
    memory = gen.track(open_memory_tier(args.memory_snapshot_every, synchronous=args.memory_sync))
    restored_fields: dict[str, Any] = {}  # the restore's report (restore_source...): on the first progress line
    if not needs_restore and not reshard:
        restored_fields = {"reformed_in_place": True}  # DDP: the state in memory is every rank's last step
        logger.info("%s re-formed in place at step %d", ctx, trainer.step)
    else:  # the first entry, new workers in the group, or FSDP2's new mesh: every rank restores (collective)
        step_restored = dcp_step
        if memory is not None:
            from checkpoint.memory import restore

            if (report := restore(ckpt, state, memory=memory)) is not None:
                step_restored, restored_fields = report.step, report.to_json()
                logger.info("%s resumed from step %s (%s)", ctx, report.step, report.source.value)
        elif ckpt is not None and (step_restored := ckpt.load(state)) is not None:
            logger.info("%s resumed from step %s", ctx, step_restored)
        gen.restored(step_restored)  # survivors and new workers restored the same step, or all restart alike
        if gen.reformed:
            restored_fields["reformed_in_place"] = True
    if (ckpt is not None or dcp_ckpt is not None) and trainer.step >= args.steps and rank == 0 and not gen.reformed:
        print(f"step {trainer.step} of {args.steps}: nothing to do, checkpoints in {args.ckpt_dir}", flush=True)
    # A notice (or a node joining) stops every rank at the same, committed step (SIGTERM under torchrun).
    preemption: Preemption | None = None
    if ckpt is not None:
        preemption = gen.preemption(sync_every=args.preempt_sync_every)
    sampler = batches.sampler(rank, world, steps=max(0, args.steps - trainer.step))
    micro = iter(DataLoader(args.dataset, batch_sampler=sampler, num_workers=args.loader_workers))
    if rank == 0 and trainer.step == 0 and not gen.reformed:
        logger.info("%s vocab=%d windows=%d params=%d uniform loss=%.3f", ctx, args.gpt.vocab, len(args.dataset),
                    sum(p.numel() for p in make_model(args.gpt).parameters()), math.log(args.gpt.vocab))

    try:
        while trainer.step < args.steps:
            plan = batches.plan(rank, world)
            optimizer.zero_grad(set_to_none=True)
            loss = global_mean_loss(train_step(model, wrapped, args.parallel, plan, micro, device), args.global_batch)
            optimizer.step()
            batches.advance()
            trainer.step += 1
            gen.completed(trainer.step)
            if args.step_time:
                time.sleep(args.step_time)
            if memory is not None:  # before a planned stop's save: a joiner restores the agreed step from memory
                # Acts every --memory-snapshot-every steps; before the step is reported, so that with --memory-sync
                # a reported step is on its buddy node unless its snapshot round failed (logged).
                memory.snapshot(trainer.step, state)
            if args.progress_file:
                append_progress(args.progress_file, {"rank": rank, "world_size": world, "step": trainer.step,
                                                     "pid": os.getpid(), "t_wall": time.time(),
                                                     "loss": loss.item(), **restored_fields, **memory_fields(memory)})
                restored_fields = {}
            if rank == 0 and (trainer.step % args.log_every == 0 or trainer.step == args.steps):
                print(f"step={trainer.step} loss={loss.item():.5f} world_size={world}", flush=True)
            if preemption is not None and preemption.save_and_stop(ckpt, trainer.step, state):
                return  # the agreed step is committed: a peer's leave re-enters here at the new size
            if trainer.step % args.ckpt_every == 0 or trainer.step == args.steps:
                if ckpt is not None:
                    ckpt.save(trainer.step, state)
                elif dcp_ckpt is not None:
                    dcp_ckpt.save(trainer.step, {"trainer": trainer, "data": batches})
        if ckpt is not None:
            ckpt.wait()
    except BaseException as exc:
        # A peer died mid-step: the state is still that of trainer.step (see train_ddp.py): snapshot it into
        # memory just in time (only for a failed collective), then go on failing.
        if memory is not None:
            memory.snapshot_on_failure(trainer.step, state, exc)
        raise


if __name__ == "__main__":
    main()
