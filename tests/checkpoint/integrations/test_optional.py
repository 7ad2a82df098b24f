"""The integrations' libraries are optional: without them checkpoint, its CLI and its HF helpers still import."""

from __future__ import annotations

import subprocess
import sys

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "lightning", "accelerate", "pytorch_lightning"):
            raise ImportError(f"{name} blocked by the test")
sys.meta_path.insert(0, Block())
import checkpoint, checkpoint.cli, checkpoint.export, checkpoint.hf
from checkpoint import Checkpointer
assert checkpoint.hf.tied_weights({"architectures": ["GPT2LMHeadModel"]}) == {}
try:
    import checkpoint.integrations.hf
except ImportError as exc:
    assert "blocked" in str(exc), exc
else:
    raise AssertionError("checkpoint.integrations.hf imported without transformers")
print("ok")
"""


def test_checkpoint_imports_without_the_integration_libraries():
    done = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "transformers is not installed" in done.stderr  # tied_weights says why it knows no ties
