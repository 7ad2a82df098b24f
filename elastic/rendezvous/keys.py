"""``RunKeys``: the names of one run's keys in etcd (``P = {etcd_prefix}/{run_id}/``).

What each key holds, and who writes it when, is told in ``etcd_v3``'s module doc; this module only names them,
so that every part of the handler spells them one way (and a join key's value, ``join_value``).
"""

from __future__ import annotations

import json

from .etcd_client import prefix_end

Range = tuple[str, bytes | None]
"""(key, range_end): one key when range_end is None, else the keys in [key, range_end)."""


class RunKeys:
    """The keys under one run's prefix ``P`` (``EtcdRendezvousConfig.run_prefix``)."""

    __slots__ = ("closed_key", "coordinator_key", "ctl", "finished_key", "health_prefix", "join_prefix",
                 "nodes_prefix", "notice_prefix", "post_prefix", "prefix", "proposal_key", "reform_key", "restart_prefix",
                 "round_key", "store_prefix")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.ctl = prefix + "ctl/"
        self.nodes_prefix = self.ctl + "nodes/"
        self.join_prefix = self.ctl + "join/"
        self.round_key = self.ctl + "round"
        self.closed_key = self.ctl + "closed"
        self.notice_prefix = self.ctl + "notice/"
        self.post_prefix = self.ctl + "post/"
        self.coordinator_key = self.post_prefix + "coordinator"
        self.proposal_key = self.post_prefix + "proposal"
        self.reform_key = self.post_prefix + "reform"
        self.restart_prefix = self.ctl + "restart/"
        """Sorts between ``post/`` and ``round``: in the followers' watched range (``watched_ranges``)."""
        self.store_prefix = prefix + "store/"
        self.finished_key = prefix + "finished"
        self.health_prefix = prefix + "health/"
        """Outside ``ctl/``: no mirror watches it, so a node's health report never wakes the rendezvous."""

    def join_key(self, target: int, node: str) -> str:
        """``P/ctl/join/{round}/{node}``: ``node`` wants to be in round ``target`` (value: :func:`join_value`)."""
        return f"{self.join_prefix}{target}/{node}"

    def watched_ranges(self, full: bool) -> list[Range]:
        """The key ranges the mirror follows: all of ``P/ctl/`` (full view), else the closed key and
        ``[notice/, round]``, which holds the notices, the coordinator's posts, the restart announcements and the
        round key, not the registrations or joins (``ctl/nodes/`` sorts before ``ctl/notice/``)."""
        if full:
            return [(self.ctl, prefix_end(self.ctl))]
        return [(self.closed_key, None), (self.notice_prefix, (self.round_key + "\0").encode())]


def join_value(seq: int | None, addr: str) -> str:
    """A join key's JSON: the node's ordering key (its first registration's revision) and its address."""
    return json.dumps({"seq": seq, "addr": addr})
