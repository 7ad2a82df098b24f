"""Code that runs inside the training processes, apart from the agent's modules.

* ``mailbox``        the agent<->worker mailbox protocol (the one module both sides import)
* ``preemption``     ``Preemption``: every rank stops at the same step and commits it for a planned change
* ``heartbeat``      progress beats and stack dumps for the agent's hang detection
* ``data``           the elastic data cursor: one global position, each rank's share at any world size
* ``deterministic``  a fixed-order shard gradient reducer (bit-identical results at any world size)
* ``runfiles``       per-run file names an agent and its workers both derive from torch's environment
* ``reform``         ``InPlaceReform`` (prototype, ``SPOTRUN_REFORM_IN_PLACE=1``): surviving workers rebuild
                     their process group at the new world size instead of being replaced
* ``abort``          ``abort_process_group``: from a watcher thread, make a collective blocked in the main
                     thread raise (NCCL: the group's abort; gloo: its connections shut)
* ``watcher``        ``PeerLossWatcher``: started by ``Preemption`` under spotrun, aborts the group when the agent
                     posts a peer loss (``peer-lost.json``)

Nothing here imports the agent (``elastic.agent``, ``elastic.launcher``, the rendezvous): a worker pays
for what it uses. The old import paths (``elastic.preemption``, ``elastic.data``, ``elastic.deterministic``,
``elastic.progress``) re-export these modules' public names.
"""
