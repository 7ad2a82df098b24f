"""spotrun-ckpt end to end: ls, inspect, verify, export, rm (in process, plus one real console-script run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from checkpoint.api import step_dir
from checkpoint.checkpointer import Checkpointer
from checkpoint.cli import main, parse_size
from checkpoint.config import CheckpointConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    state = {
        "w": torch.randn(64, 33),
        "b": torch.randn(33).to(torch.bfloat16),
        "n": torch.arange(7),
        "s": torch.tensor(1.5),
    }
    uri = str(tmp_path / "run")
    with Checkpointer(uri, CheckpointConfig(keep_last=5, checksum_block_bytes=4096)) as ckpt:
        for step in (10, 20):
            ckpt.save(step, state)
        ckpt.wait()
    return uri, state


def test_ls_and_inspect(saved, capsys) -> None:
    uri, _ = saved
    os.makedirs(f"{uri}/{step_dir(30)}")  # an uncommitted leftover
    assert main(["ls", uri]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and "uncommitted" in out and "latest good step: 20" in out
    assert main(["inspect", uri, "--step", "10"]) == 0
    out = capsys.readouterr().out
    assert "step 10" in out and "w  F32  [64, 33]  whole" in out and "b  BF16  [33]" in out


def test_verify_ok_then_detects_flipped_byte(saved, capsys) -> None:
    uri, _ = saved
    assert main(["verify", uri, "--no-progress"]) == 0
    assert "step 20: OK" in capsys.readouterr().out
    shard = Path(uri, step_dir(20), "shard-00000-of-00001.safetensors")
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01
    shard.write_bytes(bytes(data))
    assert main(["verify", uri, "--step", "20", "--no-progress"]) == 4
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "shard-00000-of-00001.safetensors" in err


def test_export_loads_with_safetensors(saved, tmp_path, capsys) -> None:
    uri, state = saved
    out = tmp_path / "hf"
    assert main(["export", uri, str(out), "--max-shard-size", "4KB", "--no-progress"]) == 0
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) >= 2 and files[0].startswith("model-00001-of-")
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        loaded.update(safetensors.torch.load_file(str(out / f)))
    assert loaded.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    import json

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(files)


def test_rm_refuses_newest_without_force(saved, capsys) -> None:
    uri, _ = saved
    assert main(["rm", uri, "--step", "20"]) == 1
    assert "--force" in capsys.readouterr().err
    assert main(["rm", uri, "--step", "10"]) == 0
    assert not Path(uri, step_dir(10)).exists()
    assert main(["rm", uri, "--step", "20", "--force"]) == 0
    assert main(["rm", uri, "--step", "99"]) == 3


def test_errors_have_distinct_exit_codes(tmp_path, capsys) -> None:
    assert main(["ls", str(tmp_path / "nothing")]) == 3
    assert "no checkpoint at" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nothing")]) == 3
    with pytest.raises(SystemExit) as exc:
        main(["export", str(tmp_path), str(tmp_path / "o"), "--max-shard-size", "lots"])
    assert exc.value.code == 2
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 << 20


def test_console_script_runs(saved) -> None:
    uri, _ = saved
    exe = Path(sys.executable).with_name("spotrun-ckpt")
    done = subprocess.run([str(exe), "ls", uri], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "latest good step: 20" in done.stdout
    done = subprocess.run([str(exe), "verify", uri + "-missing"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "no checkpoint at" in done.stderr


def test_cli_against_s3_with_storage_options(moto_endpoint, tmp_path, capsys) -> None:
    import json
    import uuid

    from tests.checkpoint.conftest import BUCKET, s3_options

    uri = f"s3://{BUCKET}/cli-{uuid.uuid4().hex[:8]}"
    state = {"w": torch.randn(100, 10), "n": torch.arange(3)}
    with Checkpointer(uri, CheckpointConfig(storage_options=s3_options(moto_endpoint))) as ckpt:
        ckpt.save(4, state)
    opts = [
        "-o", f"endpoint_url={moto_endpoint}",
        "-o", "key=testing",
        "-o", "secret=testing",
        "-o", "client_kwargs=" + json.dumps({"region_name": "us-east-1"}),
    ]
    assert main(["ls", uri, *opts]) == 0
    assert "latest good step: 4" in capsys.readouterr().out
    assert main(["verify", uri, "--no-progress", *opts]) == 0
    assert main(["export", uri, str(tmp_path / "hf"), "--no-progress", *opts]) == 0
    loaded = safetensors.torch.load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["n"], state["n"])
