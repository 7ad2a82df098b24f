"""The deploy tests reuse the checkpoint suite's real S3 server (moto_server on a free loopback port)."""

from tests.checkpoint.conftest import BUCKET, moto_endpoint  # noqa: F401 (fixture re-exported)
