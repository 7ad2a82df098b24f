"""``spotrun-ckpt``: list, inspect, verify, export and delete checkpoints.

Examples::

    spotrun-ckpt ls /fsx/run1
    spotrun-ckpt inspect s3://bucket/run1 --step 1000 --storage-option endpoint_url=http://127.0.0.1:9000
    spotrun-ckpt verify /fsx/run1                    # every checksum of the latest good step
    spotrun-ckpt export /fsx/run1 ./hf --max-shard-size 5GB
    spotrun-ckpt export /fsx/run1 ./hf --key model --config ./config.json   # loads with from_pretrained("./hf")
    spotrun-ckpt import /fsx/run2 ./gpt2-dir --key model --step 0           # start a run from a HF model
    spotrun-ckpt rm /fsx/run1 --step 900

Exit codes: 0 success, 1 other checkpoint error, 2 usage, 3 not found, 4 corrupt, 5 incompatible, 6 storage.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from fsspec.core import split_protocol
from tqdm import tqdm

from checkpoint.api import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    Manifest,
    step_dir,
)
from checkpoint.checksum import crc32, crc32_combine
from checkpoint.config import CheckpointConfig
from checkpoint.discover import (
    check_files,
    latest_good_step,
    list_steps,
    read_checksummed,
    read_manifest,
    read_objects,
    read_rank_objects,
    require_checkpoint,
    resolve_step,
    validate_step,
)
from checkpoint.dtypes import element_size
from checkpoint.hf import CONFIG, from_hf, read_config, tied_weights
from checkpoint.plan import validate_tiling
from checkpoint.retention import delete_step
from checkpoint.storage import Storage
from checkpoint.verify import BlockVerifier, truncated

logger = logging.getLogger(__name__)

EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (CheckpointNotFoundError, 3),
    (CorruptCheckpointError, 4),
    (IncompatibleCheckpointError, 5),
    (CheckpointStorageError, 6),
    (CheckpointError, 1),
]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1048576"`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (use e.g. 5GB, 500MiB or a number of bytes)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return value


def parse_option(text: str) -> tuple[str, Any]:
    """``key=value`` (value parsed as JSON when it is JSON: numbers, booleans, objects)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--storage-option {text!r} must look like key=value")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def parse_tie(text: str) -> tuple[str, str]:
    """``TARGET=SOURCE`` of ``--tie``."""
    target, sep, source = text.partition("=")
    if not sep or not target or not source:
        raise argparse.ArgumentTypeError(f"expected TARGET=SOURCE (e.g. lm_head.weight=transformer.wte.weight), got {text!r}")
    return target, source


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotrun-ckpt", description="Inspect and manage spotrun checkpoints (local, FSx, s3://, memory://)."
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("uri", help="checkpoint root (path or URI)")
    common.add_argument(
        "--storage-option",
        "-o",
        action="append",
        default=[],
        type=parse_option,
        metavar="KEY=VALUE",
        help="fsspec option, e.g. endpoint_url=http://127.0.0.1:9000 (repeatable)",
    )
    common.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", parents=[common], help="list steps: committed or not, size, world size")
    p = sub.add_parser("inspect", parents=[common], help="tensors, shapes, dtypes and chunking of a step")
    p.add_argument("--step", type=int, help="step to inspect (default: latest good)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p = sub.add_parser("verify", parents=[common], help="check every checksum of a step")
    p.add_argument("--step", type=int, help="step to verify (default: latest good)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser("export", parents=[common], help="consolidated Hugging Face-style safetensors directory")
    p.add_argument("out", help="output directory (path or URI)")
    p.add_argument("--step", type=int, help="step to export (default: latest good)")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), help="per output file (default 5GB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--key", help="export only this top-level entry (e.g. model), names without its prefix (default: every tensor)"
    )
    p.add_argument(
        "--config",
        metavar="PATH",
        help="the model's config.json: copied into the export; its architecture's tied weights are written once",
    )
    p.add_argument(
        "--tie", action="append", default=[], type=parse_tie, metavar="TARGET=SOURCE",
        help="a tied weight written once under SOURCE, as save_pretrained does (repeatable; adds to --config's)",
    )
    p = sub.add_parser("import", parents=[common], help="a Hugging Face safetensors directory as a new step")
    p.add_argument("src", help="local directory with model.safetensors or model.safetensors.index.json")
    p.add_argument("--key", default="model", help="top-level entry the tensors go under (default: model)")
    p.add_argument("--step", type=int, default=0, help="step to write (default: 0)")
    p = sub.add_parser("rm", parents=[common], help="delete one step")
    p.add_argument("--step", type=int, required=True, help="step to delete")
    p.add_argument("--force", action="store_true", help="also delete the newest committed step")
    return parser


def _storage(args: argparse.Namespace, uri: str | None = None) -> Storage:
    """Storage for the checkpoint URI; an export target gets the options only if it uses the same protocol."""
    options = dict(args.storage_option)
    if uri is not None and split_protocol(uri)[0] != split_protocol(args.uri)[0]:
        options = {}
    return Storage(uri or args.uri, storage_options=options)


def cmd_ls(args: argparse.Namespace) -> int:
    storage = _storage(args)
    listing = list_steps(storage)
    if not listing.committed and not listing.uncommitted:
        require_checkpoint(storage, listing)
    good = latest_good_step(storage, listing=listing)
    print(f"{'step':>12}  {'status':<12} {'size':>10}  {'world':>5}  created")
    for step in sorted([*listing.committed, *listing.uncommitted, *listing.unreadable]):
        status, world, created = "uncommitted", "-", "-"
        if step in listing.unreadable:
            status, created = "UNREADABLE", listing.unreadable[step][:80]
        elif step in listing.committed:
            try:
                manifest = validate_step(storage, step)
                status = "committed"
                world = str(manifest.world_size)
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(manifest.created_unix))
            except (CorruptCheckpointError, IncompatibleCheckpointError) as exc:
                status = "CORRUPT"
                created = str(exc)[:80]
            except CheckpointStorageError as exc:
                status, created = "UNREADABLE", str(exc)[:80]
        mark = " *" if step == good else ""
        print(f"{step:>12}  {status:<12} {human(listing.sizes.get(step, 0)):>10}  {world:>5}  {created}{mark}")
    print(f"latest good step: {good if good is not None else 'none'}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = _storage(args)
    manifest = resolve_step(storage, args.step)
    if args.json:
        print(json.dumps(manifest.to_json(), indent=1))
        return 0
    created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(manifest.created_unix))
    print(f"step {manifest.step}  world size {manifest.world_size}  created {created}  spotrun {manifest.library_version}")
    print(f"files: {len(manifest.files)}, {human(sum(f.size for f in manifest.files.values()))}")
    for name, frec in sorted(manifest.files.items()):
        print(f"  {name}  {human(frec.size)}  rank {frec.rank}  crc32 {frec.crc32:08x}")
    if manifest.rank_objects:
        keys = sorted({k for r in manifest.rank_objects.values() for k in r.keys})
        print(f"per-rank entries: {', '.join(keys)} ({len(manifest.rank_objects)} files, one per saving rank)")
        for name, rrec in sorted(manifest.rank_objects.items(), key=lambda nr: nr[1].rank):
            print(f"  rank {rrec.rank}: {name}  {human(rrec.size)}  crc32 {rrec.crc32:08x}  keys {', '.join(sorted(rrec.keys))}")
    print(f"tensors: {len(manifest.tensors)}")
    for fqn, rec in sorted(manifest.tensors.items()):
        chunking = "whole" if len(rec.chunks) == 1 else f"{len(rec.chunks)} chunks"
        print(f"  {fqn}  {rec.dtype}  {list(rec.shape)}  {chunking}")
        if len(rec.chunks) > 1 or args.verbose:
            for c in rec.chunks:
                print(f"      offsets {c.offsets} lengths {c.lengths} -> {c.file} bytes {c.byte_range}")
    return 0


def verify_manifest(storage: Storage, manifest: Manifest, *, progress: bool = True) -> list[str]:
    """Read every byte of every shard once: whole-file crc32 and every chunk block crc32. Returns problems."""
    rel = step_dir(manifest.step)
    by_file: dict[str, list[tuple[str, Any]]] = {name: [] for name in manifest.files}
    problems: list[str] = []
    for fqn, rec in manifest.tensors.items():
        for c in rec.chunks:
            if c.file not in by_file:
                problems.append(f"tensor {fqn!r} points to {c.file}, which the manifest does not list")
                continue
            by_file[c.file].append((fqn, c))
    block = manifest.checksum_block_bytes
    total = sum(f.size for f in manifest.files.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"verify step {manifest.step}", disable=not progress) as bar:
        for name, frec in sorted(manifest.files.items()):
            path = f"{rel}/{name}"
            crc, pos = 0, 0

            def take(start: int, end: int, path: str = path) -> bytes | bytearray:
                data = storage.read_range(path, start, end)
                bar.update(len(data))
                return data

            try:
                for fqn, c in sorted(by_file[name], key=lambda fc: fc[1].byte_range[0]):
                    start, end = c.byte_range
                    if start > pos:
                        gap = take(pos, start)
                        crc = crc32(gap, crc)
                        if len(gap) != start - pos:
                            raise truncated(storage.display(path), name, None, pos, start, len(gap))
                    verifier = BlockVerifier(
                        c.block_crc32, path=storage.display(path), file=name, fqn=fqn, chunk_start=start,
                        start=start, end=end, block_bytes=block, on_mismatch=lambda e: problems.append(str(e)),
                    )
                    for b0 in range(start, end, block):
                        data = take(b0, min(b0 + block, end))
                        if len(data) != min(b0 + block, end) - b0:
                            raise truncated(storage.display(path), name, fqn, b0, min(b0 + block, end), len(data))
                        verifier.feed(data)
                        crc = crc32_combine(crc, verifier.block_crcs[-1], len(data))
                    pos = max(pos, end)
                if pos < frec.size:
                    crc = crc32(take(pos, frec.size), crc)
                if storage.size(path) != frec.size:
                    problems.append(f"{storage.display(path)} has {storage.size(path)} bytes, manifest says {frec.size}")
                elif crc != frec.crc32:
                    problems.append(f"whole-file crc32 of {storage.display(path)} differs from the manifest")
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
            except CheckpointStorageError as exc:
                problems.append(f"cannot read {storage.display(path)}: {exc}")
    return problems


def verify_rank_objects(storage: Storage, manifest: Manifest) -> list[str]:
    """Read every per-rank objects file whole and check its size, crc32 and content. Returns problems."""
    problems: list[str] = []
    for rrec in sorted(manifest.rank_objects.values(), key=lambda r: r.rank):
        try:
            read_rank_objects(storage, manifest, rrec.rank)
        except (CorruptCheckpointError, CheckpointStorageError) as exc:
            problems.append(str(exc))
    return problems


def structure_problems(storage: Storage, manifest: Manifest) -> list[str]:
    """The checks ``load`` applies before reading a byte (``validate_step``), as problems: chunks tile every
    tensor, byte ranges lie inside files whose recorded sizes are their real sizes, names stay in the step."""
    problems = []
    for check in (validate_tiling, lambda m: check_files(storage, m)):
        try:
            check(manifest)
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
    return problems


def header_problems(storage: Storage, manifest: Manifest) -> list[str]:
    """Each shard's safetensors header against the manifest: every chunk is there with its dtype, shape and
    byte range (what ``safetensors.load_file`` would read must be what spotrun reads)."""
    from checkpoint.shard import read_header  # imports torch: ls and inspect stay torch-free

    rel = step_dir(manifest.step)
    problems: list[str] = []
    by_file: dict[str, list[tuple[str, str, Any]]] = {name: [] for name in manifest.files}
    for fqn, rec in manifest.tensors.items():
        for c in rec.chunks:
            by_file.setdefault(c.file, []).append((fqn, rec.dtype, c))
    for name, chunks in sorted(by_file.items()):
        path = f"{rel}/{name}"
        try:
            start, header = read_header(storage, path)
        except (CorruptCheckpointError, CheckpointStorageError) as exc:
            problems.append(str(exc))
            continue
        for fqn, dtype, c in chunks:
            entry = header.get(c.key)
            want = {"dtype": dtype, "shape": c.lengths, "data_offsets": [c.byte_range[0] - start, c.byte_range[1] - start]}
            if not isinstance(entry, dict) or {k: entry.get(k) for k in want} != want:
                problems.append(
                    f"safetensors header of {storage.display(path)} disagrees with the manifest for tensor {fqn!r}: "
                    f"{c.key!r} is {entry!r} in the file, the manifest says {want}"
                )
    return problems


def json_file_problems(storage: Storage, manifest: Manifest) -> list[str]:
    """``objects.json`` and the index against their checksums in the manifest (what ``load`` reads of them)."""
    problems: list[str] = []
    for name in sorted(manifest.checksums):
        try:
            read_checksummed(storage, manifest, name)
        except (CorruptCheckpointError, CheckpointStorageError) as exc:
            problems.append(str(exc))
    if manifest.has_objects:
        try:
            read_objects(storage, manifest)
        except (CorruptCheckpointError, CheckpointStorageError) as exc:
            if str(exc) not in problems:
                problems.append(str(exc))
    return problems


def cmd_verify(args: argparse.Namespace) -> int:
    storage = _storage(args)
    # with --step, read_manifest leaves the file checks to us, so that every problem is reported
    manifest = read_manifest(storage, args.step) if args.step is not None else resolve_step(storage, None)
    problems = structure_problems(storage, manifest)
    if not problems:  # bytes are read only once the manifest's sizes are known to be the files' real ones
        problems += verify_manifest(storage, manifest, progress=not args.no_progress)
        problems += header_problems(storage, manifest)
    problems += json_file_problems(storage, manifest)
    problems += verify_rank_objects(storage, manifest)
    if problems:
        for p in problems:
            print(f"FAIL {p}", file=sys.stderr)
        print(f"step {manifest.step}: {len(problems)} problem(s)", file=sys.stderr)
        return 4
    nbytes = sum(f.size for f in manifest.files.values())
    per_rank = f", {len(manifest.rank_objects)} per-rank files" if manifest.rank_objects else ""
    print(f"step {manifest.step}: OK ({len(manifest.files)} files, {human(nbytes)}, {len(manifest.tensors)} tensors{per_rank})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from checkpoint.export import export_step, select_tensors  # imports torch: ls and inspect stay torch-free

    storage = _storage(args)
    manifest = resolve_step(storage, args.step)
    selected = select_tensors(manifest, args.key)  # before creating the output: a wrong --key leaves nothing behind
    if args.key is None and len({n.split(".", 1)[0] for n in selected}) > 1:
        print("spotrun-ckpt: note: exporting every tensor (optimizer state included) under its checkpoint name; "
              "--key model exports only the model, named as from_pretrained expects", file=sys.stderr)
    ties: dict[str, str] = {}
    config_bytes = None
    if args.config:
        ties = tied_weights(read_config(args.config))
        with open(args.config, "rb") as f:
            config_bytes = f.read()
    ties.update(dict(args.tie))
    out = _storage(args, args.out)
    out.makedirs("")
    total = sum(math.prod(manifest.tensors[f].shape) * element_size(manifest.tensors[f].dtype) for f in selected.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"export step {manifest.step}", disable=args.no_progress) as bar:
        weight_map = export_step(
            storage, manifest, out, max_shard_bytes=args.max_shard_size, progress=bar.update, key=args.key, ties=ties
        )
    if config_bytes is not None:
        out.write_bytes(CONFIG, config_bytes)
    files = sorted(set(weight_map.values()))
    print(f"exported step {manifest.step}: {len(weight_map)} tensors in {len(files)} file(s) to {out.display()}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from checkpoint.checkpointer import Checkpointer  # imports torch: ls and inspect stay torch-free

    state = from_hf(args.src)  # tied weights re-added from its config.json, so a live model's state matches
    config = CheckpointConfig(storage_options=dict(args.storage_option), async_mode=False)
    with Checkpointer(args.uri, config) as ckpt:
        ckpt.save(args.step, {args.key: state})
    print(f"imported {len(state)} tensors from {args.src} as step {args.step} of {args.uri} (under {args.key!r})")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    storage = _storage(args)
    listing = list_steps(storage)
    if args.step not in listing.committed and args.step not in listing.uncommitted:
        raise CheckpointNotFoundError(f"no step {args.step} at {storage.display()} (steps: {sorted(listing.committed + listing.uncommitted)})")
    good = latest_good_step(storage, listing=listing)
    if args.step == good and not args.force:
        print(
            f"spotrun-ckpt: error: step {args.step} is the newest good committed step at {storage.display()}; "
            f"deleting it loses the resume point. Pass --force to delete it anyway.",
            file=sys.stderr,
        )
        return 1
    newest = max(listing.committed, default=-1)
    if args.step in listing.uncommitted and args.step > newest and not args.force:
        print(
            f"spotrun-ckpt: error: step {args.step} at {storage.display()} is not committed and newer than every "
            f"committed step: a job may be writing it right now. Pass --force to delete it anyway.",
            file=sys.stderr,
        )
        return 1
    delete_step(storage, args.step)
    print(f"deleted step {args.step}")
    return 0


COMMANDS = {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify, "export": cmd_export, "import": cmd_import, "rm": cmd_rm}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # ``spotrun-ckpt inspect | head``: the reader left; exit quietly like cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by the broken pipe
    except CheckpointError as exc:
        print(f"spotrun-ckpt: error: {exc}", file=sys.stderr)
        for kind, code in EXIT_CODES:
            if isinstance(exc, kind):
                return code
        return 1  # pragma: no cover
    except KeyboardInterrupt:
        print("spotrun-ckpt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
