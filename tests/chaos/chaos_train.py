"""examples/train_ddp.py with ``chaos://`` registered: an installed spotrun registers it through its fsspec
entry point, a source tree (the tests' PYTHONPATH) does not. Same arguments as train_ddp.py."""

import runpy
import sys
from pathlib import Path

from elastic.chaos.storage import register

register()
sys.argv[0] = str(Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py")
runpy.run_path(sys.argv[0], run_name="__main__")
