"""Block verification: the one check of chunk bytes against the manifest's per-block crc32s, and the one
wording of its errors.

Used by every reader of shard data: the load's ranged reads (``shard.verified_range``), its direct reads
into the destination tensor (``shard._read_direct``, piece by piece while the bytes are in the CPU cache)
and ``spotrun-ckpt verify`` (``cli.verify_manifest``, every byte of a step). Blocks are counted from the
chunk's start, the last one short (see ``api.ChunkRecord.block_crc32``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from checkpoint.api import CorruptCheckpointError
from checkpoint.checksum import crc32


def truncated(path: str, file: str, fqn: str | None, start: int, end: int, got: int) -> CorruptCheckpointError:
    """``path`` (as displayed) ended before byte ``end``: only ``got`` of ``[start, end)`` could be read."""
    what = f"tensor {fqn!r} needs" if fqn is not None else "the manifest lists"
    return CorruptCheckpointError(
        f"shard {path} is truncated: {what} bytes [{start}, {end}) but only {got} could be read",
        file=file,
        tensor=fqn,
    )


def too_few_blocks(path: str, file: str, fqn: str, listed: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"manifest lists {listed} checksum blocks for tensor {fqn!r} in {path}, fewer than its size needs",
        file=file,
        tensor=fqn,
    )


def mismatch(path: str, file: str, fqn: str, block: int, start: int, end: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checksum mismatch in {path} for tensor {fqn!r} (block {block}, bytes [{start}, {end}))",
        file=file,
        tensor=fqn,
    )


class BlockVerifier:
    """Checks the bytes ``[start, end)`` of one chunk, fed in order in pieces of any size, against its block
    crc32s; ``start`` lies on a block boundary of the chunk (``chunk_start``). A mismatching block goes to
    ``on_mismatch(error)`` (default: raise it) and checking continues with the next block."""

    def __init__(
        self,
        expected: Sequence[int],
        *,
        path: str,
        file: str,
        fqn: str,
        chunk_start: int,
        start: int,
        end: int,
        block_bytes: int,
        on_mismatch: Callable[[CorruptCheckpointError], None] | None = None,
    ) -> None:
        self.expected, self.path, self.file, self.fqn = expected, path, file, fqn
        self.block_bytes = block_bytes
        self.start, self.end = start, end
        self.first = (start - chunk_start) // block_bytes
        if self.first + -(-(end - start) // block_bytes) > len(expected):
            raise too_few_blocks(path, file, fqn, len(expected))
        self.on_mismatch = on_mismatch
        self.pos = start
        self.running = 0
        """crc32 of the bytes of the current block seen so far."""
        self.block_crcs: list[int] = []
        """crc32 of every completed block, in order (``cli.verify_manifest`` folds them into the file's crc32)."""

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            block_end = min(self.pos - (self.pos - self.start) % self.block_bytes + self.block_bytes, self.end)
            take = min(len(view), block_end - self.pos)
            self.running = crc32(view[:take], self.running)
            self.pos += take
            view = view[take:]
            if self.pos == block_end:
                self._close_block(block_end)

    def _close_block(self, block_end: int) -> None:
        index = len(self.block_crcs)
        self.block_crcs.append(self.running)
        self.running = 0
        if self.block_crcs[-1] != self.expected[self.first + index]:
            error = mismatch(
                self.path, self.file, self.fqn, self.first + index, self.start + index * self.block_bytes, block_end
            )
            if self.on_mismatch is None:
                raise error
            self.on_mismatch(error)
