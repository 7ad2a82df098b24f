"""The checkpoint format's checksum: zlib's crc32 (IEEE 802.3), computed as fast as this machine allows.

The manifest stores plain zlib crc32 values, so any tool can check a shard with ``zlib.crc32``. We compute
them with ISA-L (``isal.isal_zlib.crc32``, the same function, PCLMULQDQ-folded: several times faster than
``zlib.crc32``, see docs/benchmarks.md) when the ``isal`` wheel is installed, and fall back to zlib
otherwise. Verification on load costs one crc pass over every byte read, so this is what sets the verified
load's throughput.

ISA-L's crc32 releases the GIL on large buffers, so parallel read threads verify their blocks side by side.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from functools import lru_cache

logger = logging.getLogger(__name__)

Crc32 = Callable[..., int]


def _pick() -> tuple[Crc32, str]:
    try:
        from isal import isal_zlib
    except ImportError:  # no wheel for this platform: correct, just slower
        return zlib.crc32, "zlib"
    probe = b"spotrun-checkpoint crc32 probe" * 37
    if isal_zlib.crc32(probe) != zlib.crc32(probe) or isal_zlib.crc32(probe, 12345) != zlib.crc32(probe, 12345):
        logger.warning("isal_zlib.crc32 disagrees with zlib.crc32 on this machine; using zlib")
        return zlib.crc32, "zlib"
    return isal_zlib.crc32, "isal"


crc32, IMPLEMENTATION = _pick()
"""``crc32(data, value=0) -> int``: identical results to ``zlib.crc32``."""


# --------------------------------------------------------------------------- crc32 combination
_CRC_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) mod p(x) over GF(2), reflected bit order (zlib's multmodp)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()


@lru_cache(maxsize=256)
def _x8nmodp(nbytes: int) -> int:
    p = 1 << 31  # x^0
    k = 3  # bytes -> bits
    n = nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (no second pass over the data).

    Python's zlib module does not expose zlib's own ``crc32_combine``; this is the same algorithm
    (a few microseconds per call, independent of ``len2``'s bytes).
    """
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2
