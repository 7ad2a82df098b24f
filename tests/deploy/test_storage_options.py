"""The two documented ways to reach a non-AWS S3 endpoint from the example trainer, against a real S3 API
(moto_server over HTTP): ``--storage-option endpoint_url=...`` and ``AWS_ENDPOINT_URL``; plus bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from checkpoint.storage import Storage
from tests.checkpoint.conftest import s3_options
from tests.deploy.conftest import BUCKET
from tests.deploy.manifests import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TRAIN = str(REPO / "examples" / "train_ddp.py")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PYTHONPATH=str(REPO), AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1", **extra)
    return env


def _train(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, TRAIN, "--steps", "3", "--ckpt-every", "3", *args],
                          check=False, env=env, cwd=cwd, capture_output=True, text=True, timeout=100)


@pytest.mark.parametrize("how", ["storage_option", "AWS_ENDPOINT_URL"])
def test_example_saves_to_a_custom_s3_endpoint(how: str, moto_endpoint: str, tmp_path: Path) -> None:
    uri = f"s3://{BUCKET}/train-{uuid.uuid4().hex[:8]}"
    # _env() drops the caller's AWS_* variables, so the endpoint comes only from the form under test.
    if how == "storage_option":
        result = _train(["--ckpt-dir", uri, "--storage-option", f"endpoint_url={moto_endpoint}"], _env(), tmp_path)
    else:
        result = _train(["--ckpt-dir", uri], _env(AWS_ENDPOINT_URL=moto_endpoint), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    storage = Storage(uri, storage_options=s3_options(moto_endpoint))
    assert storage.exists("step-000000003/.commit")
    assert bytes(storage.read_bytes("latest")).decode().strip() == "step-000000003"


@pytest.mark.parametrize(("args", "message"), [
    (["--ckpt-dir", "x", "--storage-option", "endpoint_url"], "must look like key=value"),
    (["--storage-option", "endpoint_url=http://h:9000"], "pass --ckpt-dir too"),
])
def test_bad_storage_option_is_a_usage_error(args: list[str], message: str, tmp_path: Path) -> None:
    result = _train(args, _env(), tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
