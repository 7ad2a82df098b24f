"""The Collective without a process group: every collective is the local identity (world size 1)."""

from __future__ import annotations

import pytest

from checkpoint.collective import Collective, open_collectives


def test_local_collective_is_the_identity() -> None:
    c = Collective()
    assert (c.rank, c.world_size) == (0, 1)
    assert c.any(False, True, False) == (False, True, False)
    assert c.max(2) == 2
    assert c.all_gather({"a": [1, 2]}) == [{"a": [1, 2]}]
    assert c.gather("x") == ["x"]
    assert c.broadcast(None) is None
    assert c.rank0_decides(lambda: 7) == 7


def test_local_collective_refuses_a_bigger_world() -> None:
    with pytest.raises(ValueError, match="world size 1"):
        Collective(world_size=2)


def test_open_collectives_without_torch_distributed_is_local() -> None:
    from datetime import timedelta

    fg, bg = open_collectives(None, timedelta(seconds=5), 2)
    assert fg.group is None and bg.group is None and fg is not bg
