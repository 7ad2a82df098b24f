"""The ``spotrun`` command: the warm forkserver first (``elastic.boot``), then the launcher (``elastic.cli``).

The launcher's imports (torch, ~2 s) run after the forkserver has started, so that the two overlap; hence
the function-local import of ``elastic.cli``, the one module here that imports torch.
"""

from __future__ import annotations

import os
import sys

from elastic import early_notice
from elastic.boot import launch_notice_signals, start_early


def main() -> None:
    """Record notice signals from the first moment (``elastic.early_notice``), start the warm forkserver when
    argv says the launcher will want one, then run the launcher."""
    early_notice.arm(launch_notice_signals(sys.argv[1:], os.environ))
    start_early(sys.argv[1:])
    from elastic.cli import main as cli_main

    cli_main()
