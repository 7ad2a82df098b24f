"""What the checkpointer and the launcher both stand on: the operating system and torch, below both packages.

``checkpoint`` is a library usable without the launcher, and ``elastic`` builds on it, so the pieces both need
sit here, under the lower of the two, and import nothing of either (``tests/test_layering.py`` keeps it so):

* ``procutil``         process helpers: die with the parent, whether a process has exited (standard library only)
* ``rundir``           per-user, per-run names in ``/dev/shm`` and the lock-owned run directories and files, with
                       their orphan sweep (standard library only)
* ``torch_internals``  every torch internal spotrun relies on, checked at start and at test time

``procutil`` and ``rundir`` also run outside the package, loaded by file path from processes started with
``python -S`` or ``python -I -S`` (the worker exec shim, the memory tier's keeper), where the packages may not be
importable: they import nothing but the standard library.
"""
