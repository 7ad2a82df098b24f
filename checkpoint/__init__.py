"""spotrun's checkpointer: async, sharded safetensors checkpoints through fsspec, restorable at any world size."""

__version__ = "0.1.0"
