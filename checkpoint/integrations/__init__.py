"""Integrations with the trainers people use: Hugging Face ``Trainer`` (``hf``), Lightning (``lightning``) and
accelerate (``accelerate``). Each module imports its library itself, so ``import checkpoint`` never needs them;
install them with ``pip install spotrun[integrations]``.
"""
