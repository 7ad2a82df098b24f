"""Checkpoint test fixtures: the ``backend`` fixture runs a test against local disk, ``memory://`` and S3.

S3 is a real ``moto_server`` process speaking HTTP on a free loopback port, started once per session and
reaped by PID; each test gets its own prefix in one bucket.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from checkpoint.config import CheckpointConfig

BUCKET = "spotrun-ckpt-test"


@dataclass
class Backend:
    """Where a test's checkpoint lives, and the fsspec options to reach it."""

    name: str
    uri: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def config(self, **overrides: Any) -> CheckpointConfig:
        overrides.setdefault("storage_options", dict(self.storage_options))
        return CheckpointConfig(**overrides)


def _free_port() -> int:
    # Bind-release-reuse can race; the server start below retries on another port if it fails.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen[bytes], deadline: float) -> bool:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return True
        except OSError:
            time.sleep(0.05)  # poll with deadline: moto has no readiness signal
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real moto S3 server on a free loopback port; the bucket exists (us-east-1)."""
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.exists():
        pytest.fail(f"moto_server not found next to {sys.executable}; install the test extra (pip install -e .[test])")
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    proc = None
    for _attempt in range(3):
        port = _free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT
            )
        if _wait_http(f"http://127.0.0.1:{port}/", proc, time.monotonic() + 30):
            break
        _stop(proc)
        proc = None
    if proc is None:
        pytest.fail(f"moto_server did not start; log: {log.read_text()[-2000:]}")
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        _stop(proc)


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """The same test against local disk, memory:// and S3 (moto over HTTP)."""
    unique = uuid.uuid4().hex[:10]
    if request.param == "local":
        yield Backend("local", str(tmp_path / "ckpt"))
    elif request.param == "memory":
        uri = f"memory://ckpt-{unique}"
        yield Backend("memory", uri)
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(f"/ckpt-{unique}"):
            fs.rm(f"/ckpt-{unique}", recursive=True)
    else:
        endpoint = request.getfixturevalue("moto_endpoint")
        yield Backend("s3", f"s3://{BUCKET}/{unique}", s3_options(endpoint))


@pytest.fixture(autouse=True)
def _no_crash_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from checkpoint.faults import CRASH_AT_ENV

    monkeypatch.delenv(CRASH_AT_ENV, raising=False)
