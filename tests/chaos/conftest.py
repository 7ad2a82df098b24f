"""The chaos suite reuses the elastic suite's real etcd fixture (free loopback ports, reaped)."""

from tests.elastic.conftest import etcd_server  # noqa: F401 (fixture re-exported)
