"""The writer seam: one StorageSpec (JSON) for both writers, one ShardWriter per mode chosen at construction."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from checkpoint.api import CheckpointConfigError, ShardWriter
from checkpoint.config import CheckpointConfig
from checkpoint.storage import StorageSpec
from checkpoint.writer import ProcessWriter, ThreadWriter, open_writer


def test_storage_spec_maps_the_config_and_round_trips_as_json(tmp_path: Path) -> None:
    cfg = CheckpointConfig(
        max_retries=2, retry_timeout=timedelta(seconds=7), writer_threads=3, writer_nice=5,
        writeback_bytes=0, storage_options={"auto_mkdir": True},
    )
    spec = StorageSpec.from_config(str(tmp_path), cfg)
    again = StorageSpec.from_json(spec.to_json())
    assert again == spec
    storage = again.open()
    try:
        assert storage.retry.max_attempts == 2 and storage.retry.timeout == timedelta(seconds=7)
        settings = storage.settings
        assert (settings.upload_threads, settings.thread_nice, settings.writeback_bytes) == (3, 5, 0)
        assert storage.backend.writeback_bytes == 0  # type: ignore[attr-defined]  # the local backend got it
    finally:
        storage.close()


def test_storage_spec_with_unserialisable_options_names_the_fix(tmp_path: Path) -> None:
    spec = StorageSpec(uri=str(tmp_path), storage_options={"client": object()})
    with pytest.raises(CheckpointConfigError, match='JSON-serialisable storage_options.*writer="thread"'):
        spec.to_json()


def test_open_writer_chooses_the_mode_once(tmp_path: Path) -> None:
    cfg = CheckpointConfig()
    spec = StorageSpec.from_config(str(tmp_path), cfg)
    storage = spec.open()
    writer = open_writer(cfg, storage, spec, rank=0)
    try:
        assert isinstance(writer, ThreadWriter) and isinstance(writer, ShardWriter)
        assert writer.write("step-000000001", [], []).files == {}  # nothing staged: nothing written
    finally:
        writer.close()
        storage.close()
    memory = StorageSpec.from_config("memory://spec-test", cfg)
    with pytest.raises(CheckpointConfigError, match="cannot write to memory://"):
        ProcessWriter(memory, CheckpointConfig(writer="process"), rank=0)


def test_process_writer_ignores_the_users_modules_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A training repository with its own checkpoint.py: ``python -m checkpoint.writer`` from there imported it.
    repo = tmp_path / "repo"
    repo.mkdir()
    marker = tmp_path / "imported"
    (repo / "checkpoint.py").write_text(f"open({str(marker)!r}, 'a').write(__name__)\nraise SystemExit(1)\n")
    monkeypatch.chdir(repo)
    spec = StorageSpec.from_config(str(tmp_path / "ckpt"), CheckpointConfig())
    writer = ProcessWriter(spec, CheckpointConfig(writer="process"), rank=0)
    try:
        assert writer.write("step-000000001", [], []).files == {}
    finally:
        writer.close()
    assert not marker.exists()
