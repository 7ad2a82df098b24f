"""Fixtures of the chaos suite: the elastic suite's real etcd (re-exported) and a real 3-member etcd cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.chaos import targets
from tests.chaos.jobs import etcd_cluster_at
from tests.elastic.conftest import etcd_server  # noqa: F401 (fixture re-exported)


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[list[str]]:
    """Three etcd members on free loopback ports (fast elections); yields their client endpoints."""
    with etcd_cluster_at(tmp_path) as endpoints:
        yield endpoints


def leader_or_none(endpoints: list[str]) -> str | None:
    try:
        return targets.etcd_leader(endpoints)
    except Exception:  # noqa: BLE001 (not elected yet)
        return None


