"""``WorkerStoreHost``: the TCPStore that a round's workers bootstrap their process group from, hosted by
the round's rank-0 agent (``TORCHELASTIC_USE_AGENT_STORE=True``, as torchrun's default c10d backend does).

Why the agent hosts it: when rank 0's *worker* hosts the store (``use_agent_store`` False), every other
worker that calls ``init_process_group`` before rank 0 has bound MASTER_PORT gets ECONNREFUSED and waits out
TCPStore's connect backoff, on the path from a planned change's committed step to the new group's first step.
An agent-hosted store is listening before the round is committed, so no worker
ever connects too early; and the port is bound, not merely "free at commit time" (``get_free_port``'s race
with any other process on the host is gone).

One server per round, bound before the commit (its port goes into the round record) and closed when a
later round completes or the agent shuts down (a node that ``leave()``s for its notice keeps it until it exits:
its workers, and the peers', may still be tearing down their process groups). A later round's workers never
see it: a new round always starts from an empty store (no stale keys even when ``TORCHELASTIC_RESTART_COUNT`` does not change
across a planned round), as torch's own agent store guarantees.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torchrun's opt-out of its shared store) restores
torch's older behaviour: rank 0's worker hosts the store on a port that was free at commit time.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.utils.distributed import get_free_port

from .api import RendezvousConfigError

log = logging.getLogger(__name__)

ENV_DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torchrun's switch (its dynamic rendezvous reads it too): "1" -> workers host their own store."""

WORKER_STORE_TIMEOUT = timedelta(seconds=10)
"""Timeout of the server's own client, which connects to this agent's own address at start (the workers pass
their ``init_process_group`` timeout): an address this host cannot reach fails the commit in seconds."""


_NO_SUCH_NAME = frozenset(code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None)
"""getaddrinfo's answers that say the name does not exist (not "try again")."""


def agent_hosts_store() -> bool:
    """True unless the user opted out the way torchrun reads it."""
    return os.environ.get(ENV_DISABLE_SHARED_STORE, "0") != "1"


@dataclass(slots=True)
class _Hosted:
    round: int
    store: TCPStore

    @property
    def port(self) -> int:
        return int(self.store.port)


class WorkerStoreHost:
    """The workers' store of the rounds this agent commits (at most one open at a time)."""

    def __init__(self, addr: str, *, enabled: bool) -> None:
        self._addr = addr
        self._enabled = enabled
        self._hosted: _Hosted | None = None

    @property
    def enabled(self) -> bool:
        return self._enabled

    def port_for(self, round_number: int) -> int:
        """MASTER_PORT for the round this agent is about to commit: its own store's (bound now, reused by a
        retried commit of the same round), or a free port for rank 0's worker when hosting is off."""
        if not self._enabled:
            return get_free_port()
        if self._hosted is not None and self._hosted.round == round_number:
            return self._hosted.port
        self.close()
        self._check_resolves(round_number)
        try:
            # wait_for_workers=False: the server must not block for clients; workers connect when they start.
            store = TCPStore(self._addr, 0, None, True, WORKER_STORE_TIMEOUT, wait_for_workers=False)
        except (RuntimeError, OSError) as exc:  # torch's DistNetworkError/DistStoreError are RuntimeErrors
            raise self._cannot_host(round_number, str(exc)) from exc
        self._hosted = _Hosted(round_number, store)
        log.debug("hosting the workers' store of round %d on %s:%d", round_number, self._addr, self._hosted.port)
        return self._hosted.port

    def _check_resolves(self, round_number: int) -> None:
        """A name that does not resolve fails at once: TCPStore's own client would retry it for ~20 s
        (WORKER_STORE_TIMEOUT, twice) before saying the same. An address that resolves but is not this host's
        is left to TCPStore's connect, as torchrun does (it may still be reachable, e.g. through NAT)."""
        try:
            socket.getaddrinfo(self._addr, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno not in _NO_SUCH_NAME:
                return  # a resolver that failed for now (EAI_AGAIN...): TCPStore's retries may still get through
            raise self._cannot_host(round_number, f"it does not resolve ({exc})") from exc
        except UnicodeError as exc:  # a label too long or empty: never a valid name
            raise self._cannot_host(round_number, f"it is not a valid host name ({exc})") from exc

    def _cannot_host(self, round_number: int, why: str) -> RendezvousConfigError:
        return RendezvousConfigError(
            f"cannot host the workers' store of round {round_number} at {self._addr} (this agent's address, "
            f"--local-addr or the host name; the workers connect to it as MASTER_ADDR): {why}"
        )

    def round_completed(self, round_number: int, master_port: int, rank: int) -> None:
        """Keep the store only if the completed round is the one it was opened for (we committed it)."""
        hosted = self._hosted
        if hosted is not None and not (rank == 0 and hosted.round == round_number and hosted.port == master_port):
            self.close()

    def close(self) -> None:
        """Stop serving (the server's listener closes with the last reference); idempotent."""
        self._hosted = None
