"""The launcher that PyTorch's own launcher tests (``test_run.py`` beside this module) run against.

torch's tests call torchrun as ``torch.distributed.run.main(args)``; here ``main`` is what the ``spotrun`` console
script calls (``elastic.main.main``), given the same arguments. ``SPOTRUN_LAUNCHER_UNDER_TEST=torchrun`` runs the
same tests against torchrun itself, for comparison. ``parse_min_max_nnodes`` stays torch's: spotrun builds its
launch config with torch's ``config_from_args``, which parses ``--nnodes`` with it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch.distributed.run as torchrun

ENV_LAUNCHER = "SPOTRUN_LAUNCHER_UNDER_TEST"
"""``spotrun`` (default) or ``torchrun``."""

parse_min_max_nnodes = torchrun.parse_min_max_nnodes


def main(args: Sequence[str] | None = None) -> None:
    """Run the launcher under test in this process, as ``torch.distributed.run.main(args)`` does."""
    which = os.environ.get(ENV_LAUNCHER, "spotrun")
    if which == "torchrun":
        torchrun.main(args)
        return
    if which != "spotrun":
        raise ValueError(f"{ENV_LAUNCHER}={which!r}: use spotrun or torchrun")
    from elastic.main import main as spotrun_main

    spotrun_main(args)
