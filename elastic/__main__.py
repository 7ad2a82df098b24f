"""``python -m elastic`` (and ``python -m elastic.cli``): the ``spotrun`` command (``elastic.main.main``)."""

from elastic.main import main

if __name__ == "__main__":
    main()
