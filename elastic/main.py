"""The ``spotrun`` command: the warm forkserver first (``elastic.boot``), then the launcher (``elastic.cli``).

The launcher's imports (torch, ~2 s) run after the forkserver has started, so that the two overlap; hence
the function-local import of ``elastic.cli``, the one module here that imports torch.
"""

from __future__ import annotations

import sys

from elastic.boot import start_early


def main() -> None:
    """Start the warm forkserver when argv says the launcher will want one, then run the launcher."""
    start_early(sys.argv[1:])
    from elastic.cli import main as cli_main

    cli_main()
