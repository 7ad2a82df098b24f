"""Plugs the ``etcd-v3`` backend into torch's rendezvous handler registry.

torchrun finds it through the ``torchrun.handlers`` entry point (declared in pyproject.toml), calling
``handler_factory()`` and registering what it returns; spotrun calls ``register()`` directly.

torch loads this module while ``torch.distributed.elastic.rendezvous`` itself is still importing (it
scans the entry points at import time), so everything of ours and torch's is imported lazily here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from .etcd_v3 import EtcdV3RendezvousHandler

__all__ = ["create_handler", "handler_factory", "register"]


def create_handler(params: RendezvousParameters) -> EtcdV3RendezvousHandler:
    """Validate ``params`` (raises RendezvousConfigError naming the problem) and build a handler."""
    from .api import EtcdRendezvousConfig
    from .etcd_v3 import EtcdV3RendezvousHandler

    return EtcdV3RendezvousHandler(EtcdRendezvousConfig.from_parameters(params))


def handler_factory() -> Callable[[RendezvousParameters], EtcdV3RendezvousHandler]:
    """Entry point ``torchrun.handlers: etcd-v3``: torch calls ``load()()`` and registers the result."""
    return create_handler


def register() -> None:
    """Register ``etcd-v3`` in torch's global handler registry; idempotent."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from .api import BACKEND_NAME

    rendezvous_handler_registry.register(BACKEND_NAME, create_handler)
