"""Small JSON record files that workers leave for their agent (restore records, save records): listed and read
with bounds, never trusting what is there (a name pattern, a file count, a byte limit, no symlink followed,
no blocking on a FIFO)."""

from __future__ import annotations

import os
import re


def record_names(directory: str, pattern: re.Pattern[str], max_files: int) -> list[str]:
    """The paths of at most ``max_files`` files in ``directory`` whose name matches ``pattern``, sorted; none
    when the directory cannot be listed."""
    try:
        names = sorted(n for n in os.listdir(directory) if pattern.fullmatch(n))[:max_files]
    except OSError:
        return []
    return [os.path.join(directory, name) for name in names]


def read_record(path: str, max_bytes: int) -> bytes:
    """At most ``max_bytes + 1`` bytes of ``path`` (one more than allowed, so a parser can tell it was too big).

    Raises:
        OSError: it cannot be opened (gone, a symlink, not readable) or read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        return os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
