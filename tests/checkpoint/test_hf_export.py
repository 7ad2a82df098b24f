"""`spotrun-ckpt export --key model --config` loads with transformers' from_pretrained (identical weights, no
missing or unexpected keys, tied weights once); `import` / `from_hf` / `load_hf` start a run from a HF directory."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install spotrun[integrations])")
import torch
from safetensors import safe_open

from checkpoint import CheckpointConfig, Checkpointer
from checkpoint.api import IncompatibleCheckpointError
from checkpoint.cli import main
from checkpoint.hf import from_hf, load_hf


def _gpt2(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=128, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _trained_checkpoint(tmp_path):
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    uri = str(tmp_path / "ckpt")
    with Checkpointer(uri, CheckpointConfig(async_mode=False)) as ckpt:
        ckpt.save(1, {"model": model, "optim": opt, "epoch": 0})
    model.config.save_pretrained(tmp_path / "cfg")
    return model, uri, str(tmp_path / "cfg" / "config.json")


def _stored_names(directory) -> set[str]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    names = set()
    for file in set(index["weight_map"].values()):
        with safe_open(str(directory / file), "pt") as f:
            assert f.metadata()["format"] == "pt"
            names |= set(f.keys())
    assert names == set(index["weight_map"])
    return names


@pytest.mark.timeout(60)
def test_export_loads_with_from_pretrained(tmp_path, capsys):
    model, uri, config = _trained_checkpoint(tmp_path)
    out = tmp_path / "hf"
    assert main(["export", uri, str(out), "--key", "model", "--config", config, "--max-shard-size", "20KB", "--no-progress"]) == 0
    names = _stored_names(out)
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names  # tied: once, under the source
    assert not any(n.startswith(("model.", "optim")) for n in names)
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ref, got = model.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_export_without_key_notes_the_mixed_content_and_a_wrong_key_names_the_entries(tmp_path, capsys):
    _, uri, _ = _trained_checkpoint(tmp_path)
    assert main(["export", uri, str(tmp_path / "all"), "--no-progress"]) == 0
    assert "--key model" in capsys.readouterr().err
    assert any(n.startswith("optim.") for n in _stored_names(tmp_path / "all"))
    assert main(["export", uri, str(tmp_path / "bad"), "--key", "modle", "--no-progress"]) == 5
    err = capsys.readouterr().err
    assert "'modle'" in err and "['model', 'optim']" in err
    assert not (tmp_path / "bad").exists()


def test_tie_flag_and_untied_values_are_kept(tmp_path):
    _, uri, _ = _trained_checkpoint(tmp_path)
    out = tmp_path / "hf"
    # wpe is not tied to wte (different shape): the pair is refused by value, both are written
    assert main(["export", uri, str(out), "--key", "model", "--tie", "lm_head.weight=transformer.wte.weight",
                 "--tie", "transformer.wpe.weight=transformer.h.0.ln_1.weight", "--no-progress"]) == 0
    names = _stored_names(out)
    assert "lm_head.weight" not in names and {"transformer.wpe.weight", "transformer.h.0.ln_1.weight"} <= names
    with pytest.raises(SystemExit) as exc:
        main(["export", uri, str(tmp_path / "x"), "--tie", "nonsense"])
    assert exc.value.code == 2


@pytest.mark.timeout(60)
def test_import_and_load_hf_start_a_run_from_a_hf_directory(tmp_path):
    source = _gpt2(seed=1)
    hf_dir = tmp_path / "pretrained"
    source.save_pretrained(hf_dir)  # transformers' own writer: lm_head.weight omitted (tied)

    state = from_hf(str(hf_dir))
    assert state["lm_head.weight"] is state["transformer.wte.weight"]  # re-added from config.json

    fresh = _gpt2(seed=2)
    load_hf(fresh, str(hf_dir))
    for k, v in source.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k

    uri = str(tmp_path / "run")
    assert main(["import", uri, str(hf_dir), "--key", "model", "--step", "0"]) == 0
    target = _gpt2(seed=3)
    with Checkpointer(uri) as ckpt:
        assert ckpt.load({"model": target}) == 0
    for k, v in source.state_dict().items():
        assert torch.equal(v, target.state_dict()[k]), k

    wrong = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=16, vocab_size=128))
    with pytest.raises(IncompatibleCheckpointError, match="missing"):
        load_hf(wrong, str(hf_dir))
