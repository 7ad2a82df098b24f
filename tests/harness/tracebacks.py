"""Tracebacks in a launcher's log that a test did not expect.

A worker whose peer's end of a connection went away fails its collective and prints a traceback, under torchrun
too (torch's excepthook prefixes each of its lines with ``[rankN]: ``): after a node loss or a healed partition
that is the expected way for a survivor's worker to end. Anything else (the agent's own traceback, a worker's
own bug) is not.
"""

from __future__ import annotations

import re

BROKEN_COLLECTIVE = ("Connection closed by peer", "Connection reset by peer")
"""What gloo's collective raises when the peer's end of its connection is gone."""

_RANK_PREFIX = re.compile(r"\[rank\d+\]: ")
_HEADER = "Traceback (most recent call last)"


def unexpected_tracebacks(log: str, expected: tuple[str, ...] = BROKEN_COLLECTIVE) -> list[str]:
    """The error line of every traceback in ``log`` but a worker's whose error names one of ``expected``: the
    first unindented line after the header (for an agent's traceback, which has no rank prefix, the header
    itself: any is unexpected)."""
    lines = log.splitlines()
    found = []
    for i, line in enumerate(lines):
        if _HEADER not in line:
            continue
        prefix = _RANK_PREFIX.match(line)
        if prefix is None:
            found.append(line)
            continue
        body = (x[prefix.end() :] for x in lines[i + 1 :] if x.startswith(prefix.group(0)))
        error = next((x for x in body if x and not x.startswith(" ")), line)
        if not any(marker in error for marker in expected):
            found.append(error)
    return found
