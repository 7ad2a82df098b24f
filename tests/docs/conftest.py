"""The docs tests reuse the checkpoint suite's real S3 server (moto_server on a free loopback port)."""

from tests.checkpoint.conftest import moto_endpoint  # noqa: F401 (fixture re-exported)
