"""CUDA paths of the statistics: run wherever a GPU is present, skip cleanly elsewhere."""

import pytest
import torch
from torch import nn

from lightning_gradhooks import GradientMonitor
from lightning_gradhooks.stats import reduce

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_statistics_and_histograms_match_cpu():
    t = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    t[::997] = float("nan")
    small = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    (cpu, cpu_counts), (cpu_small, _) = reduce([t, small], bins=64)
    (gpu, gpu_counts), (gpu_small, _) = reduce([t.cuda(), small.cuda()], bins=64)
    assert cpu == pytest.approx(gpu, rel=1e-5, abs=1e-6) and cpu_small == pytest.approx(gpu_small, rel=1e-5, abs=1e-6)
    assert cpu_counts == gpu_counts


def test_hooks_never_synchronise_with_the_host():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64)).cuda()
    x = torch.randn(512, 64, device="cuda", requires_grad=True)
    monitor = GradientMonitor(model, forward_checks=True)
    with monitor.attach():
        records = []
        for _ in range(2):  # the first armed step is the in-place probe (no grad_input); the second is planned
            monitor.arm()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss = model(x).square().mean()  # forward hooks and forward checks run here
                loss.backward()  # every backward hook runs here: any host read would raise
            finally:
                torch.cuda.set_sync_debug_mode("default")
            records.append(monitor.collect())
            model.zero_grad(set_to_none=True)
    checks = {"weights", "forward_input", "forward"}  # the forward checks, parameterless modules too
    assert {e.kind for e in records[0].entries} == checks | {"grad_output", "param_grad"}
    assert {e.kind for e in records[1].entries} == checks | {"grad_output", "grad_input", "param_grad"}
    assert all(e.stats["nonfinite"] == 0 for record in records for e in record.entries)


def test_16_mixed_on_gpu_logs_unscaled_statistics(tmp_path):
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger

    from lightning_gradhooks import GradHooks

    from conftest import MLP, loader, read_events

    values = {}
    for offload in (None, 256):
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(
            accelerator="gpu", devices=1, precision="16-mixed", max_steps=2, enable_progress_bar=False,
            enable_checkpointing=False, logger=TensorBoardLogger(str(tmp_path), name=str(offload)),
            callbacks=[GradHooks(every_n_steps=1, offload_threshold_bytes=offload)],
        )
        trainer.fit(MLP(), loader())
        events = read_events(trainer.logger.log_dir)
        assert events.Scalars("loss_scale")[0].value == 65536.0  # GradScaler's default initial scale
        values[offload] = [e.value for e in events.Scalars("∇2 grad_output_norm/net.4")]
    # Divided by the scale: of the order of a float32 run's gradients, not 65536 times larger.
    assert all(v < 10 for v in values[None]) and values[256] == pytest.approx(values[None], rel=1e-4)
