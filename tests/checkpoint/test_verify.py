"""Block verification: any piece sizes give the same verdict, with the same message as every reader."""

from __future__ import annotations

import zlib

import pytest

from checkpoint.api import CorruptCheckpointError
from checkpoint.verify import BlockVerifier

pytestmark = pytest.mark.timeout(30)

BLOCK = 4096
DATA = bytes(range(256)) * 41  # 10496 bytes: blocks of 4096, 4096, 2304
CRCS = [zlib.crc32(DATA[i : i + BLOCK]) for i in range(0, len(DATA), BLOCK)]


def verifier(start: int = 0, end: int = len(DATA), **kw) -> BlockVerifier:
    return BlockVerifier(
        CRCS, path="root/step/shard.safetensors", file="shard.safetensors", fqn="w",
        chunk_start=0, start=start, end=end, block_bytes=BLOCK, **kw,
    )


@pytest.mark.parametrize("piece", [1, 1000, BLOCK, 5000, len(DATA)])
def test_pieces_of_any_size_pass_and_record_block_crcs(piece: int) -> None:
    v = verifier()
    for i in range(0, len(DATA), piece):
        v.feed(DATA[i : i + piece])
    assert v.block_crcs == CRCS


def test_a_ranged_check_starts_at_its_block() -> None:
    v = verifier(start=BLOCK, end=2 * BLOCK)
    v.feed(DATA[BLOCK : 2 * BLOCK])
    assert v.block_crcs == CRCS[1:2]


def test_mismatch_names_file_tensor_block_and_bytes() -> None:
    bad = bytearray(DATA)
    bad[5000] ^= 1
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in root/step/shard\.safetensors for tensor 'w' "
                       r"\(block 1, bytes \[4096, 8192\)\)") as exc:
        verifier().feed(bad)
    assert (exc.value.file, exc.value.tensor) == ("shard.safetensors", "w")
    found: list[str] = []
    bad[100] ^= 1
    verifier(on_mismatch=lambda e: found.append(str(e))).feed(bad)  # collects, goes on
    assert [m.split("(")[1] for m in found] == ["block 0, bytes [0, 4096))", "block 1, bytes [4096, 8192))"]


def test_too_few_blocks_is_corruption() -> None:
    with pytest.raises(CorruptCheckpointError, match="manifest lists 3 checksum blocks for tensor 'w'"):
        verifier(end=len(DATA) + BLOCK)
