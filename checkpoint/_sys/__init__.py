"""What the checkpointer and the launcher both stand on: the operating system and torch, below both packages.

``checkpoint`` is a library usable without the launcher, and ``elastic`` builds on it, so the pieces both need
sit here, under the lower of the two, and import nothing of either (``tests/test_layering.py`` keeps it so):

* ``procutil``         process helpers: die with the parent, whether a process has exited (standard library only)
* ``torch_internals``  the torch internals the checkpointer relies on, declared where the agent's start check
                       (``elastic.torch_internals``) finds them

Code that runs in the warm forkserver or in a worker before its script (``elastic.workers``), and the memory
tier's keeper (``python -I -S``), load ``procutil.py`` by its path instead: importing it through this package
would bind the name ``checkpoint`` where a training script's own ``checkpoint`` module must be found.
"""
