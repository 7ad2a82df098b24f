"""accelerate: a loop interrupted mid-epoch and resumed through save_state/load_state ends bit-identical."""

from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate", reason="needs accelerate (pip install spotrun[integrations])")
import torch

from checkpoint import CheckpointConfig, Checkpointer
from checkpoint.integrations.accelerate import load_state, save_state, skip_batches

EPOCHS, SAVE_EVERY = 3, 2


class _Crash(Exception):
    pass


def _train(uri: str, crash_at: int | None = None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(5))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    progress = {"epoch": 0, "batch": 0, "step": 0}
    with Checkpointer(uri, CheckpointConfig(async_mode=False)) as ckpt:
        resumed = load_state(accelerator, ckpt, progress=progress) is not None
        try:
            for epoch in range(progress["epoch"], EPOCHS):
                skip = progress["batch"] if resumed and epoch == progress["epoch"] else 0
                batches = skip_batches(accelerator, loader, skip)
                for i, (xb, yb) in enumerate(batches, start=skip):
                    if progress["step"] == crash_at:
                        raise _Crash
                    loss = torch.nn.functional.mse_loss(model(xb), yb)
                    accelerator.backward(loss)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                    progress = {"epoch": epoch, "batch": i + 1, "step": progress["step"] + 1}
                    if progress["step"] % SAVE_EVERY == 0:
                        save_state(accelerator, ckpt, progress["step"], progress=progress)
        except _Crash:
            pass
    return accelerator.unwrap_model(model), opt, sched, progress


@pytest.mark.timeout(60)
@pytest.mark.parametrize("crash_at", [7, 10], ids=["mid-epoch", "epoch-boundary"])
def test_interrupted_accelerate_loop_resumes_bit_identical(tmp_path, crash_at):
    ref_model, ref_opt, ref_sched, ref_progress = _train(str(tmp_path / "a"))
    uri = str(tmp_path / "b")
    _, _, _, crashed = _train(uri, crash_at=crash_at)
    assert crashed["step"] == crash_at
    model, opt, sched, progress = _train(uri)
    assert progress == ref_progress == {"epoch": EPOCHS - 1, "batch": 5, "step": 15}
    for (name, a), (_, b) in zip(ref_model.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), f"{name} differs after the resume"
    assert sched.state_dict() == ref_sched.state_dict()
    for pid, st in ref_opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, opt.state_dict()["state"][pid][k]), (pid, k)
