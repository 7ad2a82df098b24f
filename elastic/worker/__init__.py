"""Code that runs inside the training processes, apart from the agent's modules.

* ``mailbox``        the agent<->worker mailbox protocol (the one module both sides import)
* ``preemption``     ``Preemption``: every rank stops at the same step and commits it for a planned change
* ``heartbeat``      progress beats and stack dumps for the agent's hang detection
* ``data``           the elastic data cursor: one global position, each rank's share at any world size
* ``deterministic``  a fixed-order shard gradient reducer (bit-identical results at any world size)
* ``runfiles``       per-run file names an agent and its workers both derive from torch's environment
* ``inplace``        ``run``: re-enters the training function in the same process with the re-formed group
                     (public path: ``elastic.inplace``), releasing what held the old one
* ``reform``         ``InPlaceReform``: the wait for the re-formed group and the join, under ``inplace``
* ``abort``          ``abort_process_group``: from a watcher thread, make a collective blocked in the main
                     thread raise (NCCL: the group's abort; gloo: its connections shut)
* ``watcher``        ``PeerLossWatcher``: started by ``Preemption`` under spotrun, aborts the group when the agent
                     posts a peer loss (``peer-lost.json``)

Nothing here imports the agent (``elastic.agent``, ``elastic.launcher``, the rendezvous): a worker pays
for what it uses. The old import paths (``elastic.preemption``, ``elastic.data``, ``elastic.deterministic``,
``elastic.progress``) re-export these modules' public names.
"""
