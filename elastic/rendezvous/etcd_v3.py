"""etcd v3 rendezvous handler (skeleton: interface landed first, implementation follows)."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousInfo

from .api import BACKEND_NAME, EtcdRendezvousConfig


class EtcdV3RendezvousHandler(RendezvousHandler):
    """torch ``RendezvousHandler`` over etcd v3 leases, watches and transactions.

    Extra public methods (beyond torch's interface):
        membership_changed() -> bool: non-blocking; True once the current round is broken (a participant
            lost its lease or re-joined) or a waiting node would get a slot. Equivalent to
            ``num_nodes_waiting() > 0`` plus the sticky "participant lost" mark.
        wait_membership_change(timeout: float) -> bool: blocks until membership_changed() is True
            (returns True) or ``timeout`` seconds pass / the handler shuts down (returns False).
        leave() -> None: revoke this node's lease and release resources WITHOUT closing the job
            (use on preemption: peers learn at once instead of after lease_ttl).
        node_id (property): this agent's id, stable across rounds.
        round (property): number of the last round this node completed, None before.
    """

    def __init__(self, config: EtcdRendezvousConfig, *, node_id: str | None = None) -> None:
        self._config = config
        raise NotImplementedError

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        raise NotImplementedError

    def is_closed(self) -> bool:
        raise NotImplementedError

    def set_closed(self) -> None:
        raise NotImplementedError

    def num_nodes_waiting(self) -> int:
        raise NotImplementedError

    def get_run_id(self) -> str:
        return self._config.run_id

    def shutdown(self) -> bool:
        raise NotImplementedError

    def membership_changed(self) -> bool:
        raise NotImplementedError

    def wait_membership_change(self, timeout: float) -> bool:
        raise NotImplementedError

    def leave(self) -> None:
        raise NotImplementedError
