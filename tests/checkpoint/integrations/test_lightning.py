"""Lightning with the CheckpointerIO plugin: a run interrupted and resumed from the Checkpointer ends bit-identical
to an uninterrupted one."""

from __future__ import annotations

import pytest

L = pytest.importorskip("lightning", reason="needs lightning (pip install spotrun[integrations])")
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from checkpoint import CheckpointConfig, Checkpointer
from checkpoint.integrations.lightning import CheckpointerIO


class _Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


class _Crash(L.Callback):
    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == self.epoch:
            raise RuntimeError(f"injected interruption at epoch {self.epoch}")


def _loader():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)  # shuffled from the global RNG


def _fit(tmp_path, uri: str, *, crash_at: int | None = None, resume: bool = False):
    L.seed_everything(0, verbose=False)
    module = _Module()
    ckpt = Checkpointer(uri, CheckpointConfig(async_mode=False))
    io = CheckpointerIO(ckpt)
    callbacks = [ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_epochs=1, save_top_k=-1, save_last=True)]
    if crash_at is not None:
        callbacks.append(_Crash(crash_at))
    trainer = L.Trainer(
        max_epochs=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[io], callbacks=callbacks,
    )
    try:
        trainer.fit(module, _loader(), ckpt_path=io.latest_path() if resume else None)
    except RuntimeError as exc:
        assert "injected" in str(exc)
    finally:
        ckpt.close()
    return module, trainer


@pytest.mark.timeout(60)
def test_interrupted_lightning_run_resumes_bit_identical(tmp_path):
    full, full_trainer = _fit(tmp_path / "a", str(tmp_path / "a" / "ckpt"))
    uri = str(tmp_path / "b" / "ckpt")
    _fit(tmp_path / "b", uri, crash_at=2)
    assert Checkpointer(uri).latest() == 12  # epochs 0 and 1 saved, 6 steps each
    assert not list((tmp_path / "b" / "ckpts").glob("*.ckpt")), "Lightning wrote its own pickled checkpoint files"
    resumed, trainer = _fit(tmp_path / "b", uri, resume=True)

    assert trainer.global_step == full_trainer.global_step == 24
    ref, got = full.state_dict(), resumed.state_dict()
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k} differs after the resume"
    assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == full_trainer.lr_scheduler_configs[0].scheduler.state_dict()
