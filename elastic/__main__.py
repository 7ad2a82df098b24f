"""``python -m elastic`` (and ``python -m elastic.cli``): the ``spotrun`` command (``elastic.boot.main``)."""

from elastic.boot import main

if __name__ == "__main__":
    main()
