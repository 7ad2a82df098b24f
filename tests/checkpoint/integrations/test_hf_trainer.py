"""The HF Trainer resumed from the Checkpointer after an interruption ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install spotrun[integrations])")
import torch

from checkpoint import CheckpointConfig, Checkpointer
from checkpoint.integrations.hf import CheckpointerCallback

VOCAB = 64


def _model():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=VOCAB)
    return transformers.GPT2LMHeadModel(cfg)  # dropout 0.1: the RNG matters


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 12):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Crash(transformers.TrainerCallback):
    def __init__(self, at: int):
        self.at = at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise KeyboardInterrupt(f"injected interruption before step {self.at + 1}")


def _run(tmp_path, uri: str, *, crash_at: int | None = None, resume: bool = False, max_steps: int = 7):
    transformers.set_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        per_device_train_batch_size=2,  # 6 steps per epoch: the run crosses an epoch boundary
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    ckpt = Checkpointer(uri, CheckpointConfig(async_mode=False))
    callback = CheckpointerCallback(ckpt)
    callbacks = [callback] + ([_Crash(crash_at)] if crash_at is not None else [])
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_Data(), callbacks=callbacks)
    try:
        trainer.train(resume_from_checkpoint=callback.resume_from(trainer) if resume else None)
    except KeyboardInterrupt:
        pass
    finally:
        ckpt.close()
    return trainer


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted run, shared by the interrupted cases."""
    tmp = tmp_path_factory.mktemp("full")
    return _run(tmp, str(tmp / "ckpt"))


@pytest.mark.timeout(90)  # two short Trainer runs; most of it is the Trainer's setup on a loaded 2-core machine
@pytest.mark.parametrize("crash_at", [3, 6], ids=["mid-epoch", "epoch-boundary"])
def test_interrupted_trainer_resumes_bit_identical(tmp_path, full, crash_at):
    uri = str(tmp_path / "b" / "ckpt")
    _run(tmp_path / "b", uri, crash_at=crash_at)
    assert not list((tmp_path / "b" / "out").glob("checkpoint-*")), "the Trainer wrote its own pickled checkpoints"
    resumed = _run(tmp_path / "b", uri, resume=True)

    ref, got = full.model.state_dict(), resumed.model.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k} differs after the resume"
    assert resumed.state.global_step == full.state.global_step == 7
    assert resumed.state.epoch == full.state.epoch
    losses = lambda t: [(h["step"], h["loss"]) for h in t.state.log_history if "loss" in h]
    assert losses(resumed) == losses(full)
    assert resumed.lr_scheduler.state_dict() == full.lr_scheduler.state_dict()
    ropt, fopt = full.optimizer.state_dict(), resumed.optimizer.state_dict()
    for pid, st in ropt["state"].items():
        for name, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(fopt["state"][pid][name])), (pid, name)
