"""etcd v3 rendezvous for torch.distributed.elastic (backend name ``etcd-v3``).

Use it from torchrun or spotrun::

    torchrun --rdzv-backend etcd-v3 --rdzv-endpoint ETCD_HOST:2379 --rdzv-id JOB --nnodes 1:4 ... train.py
    torchrun ... --rdzv-conf lease_ttl=3,join_timeout=600,last_call_timeout=1,etcd_timeout=30 ...

torchrun finds the backend through the ``torchrun.handlers`` entry point; in-process code calls
``elastic.rendezvous.registry.register()``. Modules (data flow): ``api`` (config, errors) ->
``state`` (pure round decisions) -> ``etcd_v3`` (the handler torch sees) composing its parts (``mirror``,
``mirror_watch``, ``registration``, ``rounds``, ``coordinator``, ``peers``, ``cleanup``, ``health``, ``keys``:
listed in ``etcd_v3``'s module doc) with ``etcd_client`` (retrying connection) and ``store`` (the agents' c10d
store); bench/rendezvous_bench.py measures rounds.

Nothing is imported here on purpose: torch imports ``registry`` while its own rendezvous package is
still initialising.
"""
