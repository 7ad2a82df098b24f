"""The ``spotrun`` command: notices recorded from the first line (``elastic.early_notice``), a surely bad
command line rejected and the warm forkserver started (``elastic.boot``), then the launcher (``elastic.cli``).

The launcher's imports (torch, ~2 s) run after the forkserver has started, so that the two overlap; hence
the function-local import of ``elastic.cli``, the one module here that imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from elastic import early_notice
from elastic.boot import forkserver_scope, installed_torch_release, launch_notice_signals, reject_early, start_early


def main(argv: Sequence[str] | None = None) -> None:
    """``argv`` as ``torch.distributed.run.main(argv)`` takes it: None is the command line (errors: one line and
    torchrun's exit status), a list a call from Python (the launcher raises what torchrun raises, and leaves no
    forkserver and no signal handler of its own behind)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if argv is None:
        early_notice.arm(launch_notice_signals(args, os.environ))
        rejected = reject_early(args, os.environ, installed_torch_release())
        if rejected is not None:
            status, message = rejected
            print(f"spotrun: error: {message}", file=sys.stderr)
            sys.exit(status)
    with forkserver_scope():
        start_early(args)
        from elastic.cli import main as cli_main

        cli_main(argv)
