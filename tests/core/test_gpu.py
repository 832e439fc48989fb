"""The GPU path: statistics, AMP, offload, in-place refusal and steady state on a CUDA device. Run
wherever a GPU is present (``bash benchmarks/gpu_check.sh``), skipped cleanly elsewhere."""

import os

import pytest
import torch
from torch import nn

from lightning_gradhooks import GradientLog, GradientMonitor
from lightning_gradhooks.offload import save_on_disk
from lightning_gradhooks.core.stats import reduce

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MiB = 1 << 20


def reference(g: torch.Tensor) -> dict[str, float]:
    """The statistics of ``g``, in float64 on the CPU (the finite elements; ``nonfinite`` and
    ``zero_fraction`` over all)."""
    g = g.detach().double().cpu().flatten()
    finite = g[torch.isfinite(g)]
    return {
        "norm": finite.norm().item(),
        "mean": finite.mean().item(),
        "std": finite.std().item() if finite.numel() > 1 else 0.0,
        "absmax": finite.abs().max().item(),
        "nonfinite": float(g.numel() - finite.numel()),
        "zero_fraction": (g == 0).double().mean().item(),
    }


def test_cuda_statistics_match_a_float64_cpu_reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8)).cuda()
    x = torch.randn(256, 64, device="cuda")
    monitor = GradientMonitor(model)
    with monitor.attach():
        for _ in range(2):  # the first armed step may probe; compare the second
            monitor.arm()
            model(x).square().mean().backward()
            record = monitor.collect()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
    params = [e for e in record.entries if e.kind == "param_grad"]
    assert {e.name for e in params} == set(grads)
    for entry in params:
        want = reference(grads[entry.name])
        for stat, value in want.items():
            assert getattr(entry.stats, stat) == pytest.approx(value, rel=1e-4, abs=1e-7), (entry.name, stat)
        if entry.histogram is not None:
            assert sum(entry.histogram.counts) == grads[entry.name].numel()


def test_hooks_never_synchronise_with_the_host():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64)).cuda()
    x = torch.randn(512, 64, device="cuda", requires_grad=True)
    monitor = GradientMonitor(model, forward_checks=True)
    # Compiling the statistics' kernels (once per process) may time Triton configs, which
    # synchronises: compile them first, then check the steps.
    reduce([torch.randn(5000, device="cuda")], bins=monitor.bins)
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
    assert {e.kind for e in records[1].entries} >= checks | {"grad_output", "param_grad"}
    assert all(e.stats.nonfinite == 0 for record in records for e in record.entries)


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
        assert events.Scalars("∇1 overview/loss_scale")[0].value == 65536.0  # GradScaler's default initial scale
        values[offload] = [e.value for e in events.Scalars("∇2 grad_output_norm/net.4")]
    # Divided by the scale: of the order of a float32 run's gradients, not 65536 times larger.
    assert all(v < 10 for v in values[None]) and values[256] == pytest.approx(values[None], rel=1e-4)


def test_compiled_and_eager_statistics_agree_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(n, device="cuda", generator=g) for n in (1, 1000, 1 << 20, (1 << 24) + 5)]
    tensors[1][::9] = 0.0
    tensors[2][3] = float("nan")
    tensors.append(tensors[1].to(torch.bfloat16))
    for (row, counts), (want_row, want_counts) in zip(reduce(tensors, 64), reduce(tensors, 64, compiled=False)):
        assert row[3:] == want_row[3:]
        assert row[:3] == pytest.approx(want_row[:3], rel=1e-5, abs=1e-5 * want_row[2] + 1e-30)
        assert sum(counts) == sum(want_counts) and sum(abs(a - b) for a, b in zip(counts, want_counts)) <= 4


def test_16_mixed_with_fused_adam_logs_the_norms_of_unfused_adam(tmp_path):
    """Lightning makes the gradient scaler itself for ``precision="16-mixed"``; with a fused Adam
    the unscaling happens inside the optimizer step. The logged norms must not depend on it."""
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger

    from lightning_gradhooks import GradHooks

    from conftest import AdamMLP, loader, read_events

    norms = {}
    for fused in (False, True):
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(
            accelerator="gpu", devices=1, precision="16-mixed", max_steps=3, enable_progress_bar=False,
            enable_checkpointing=False, logger=TensorBoardLogger(str(tmp_path), name=f"fused{fused}"),
            callbacks=[GradHooks(every_n_steps=1)],
        )
        trainer.fit(AdamMLP(fused), loader())
        events = read_events(trainer.logger.log_dir)
        norms[fused] = [e.value for tag in ("∇4 param_grad_norm/net.0.weight", "∇4 param_grad_norm/net.4.bias")
                        for e in events.Scalars(tag)]
    assert len(norms[True]) == 6 and norms[True] == pytest.approx(norms[False], rel=1e-2)


def deep_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(6) for m in (nn.Linear(1024, 1024), nn.GELU()))).cuda()


def one_step(model: nn.Module, x: torch.Tensor, offload: save_on_disk | None) -> tuple[list[torch.Tensor], int]:
    """The parameter gradients of one step and its peak of allocated device memory."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if offload is None:
        loss = model(x).square().mean()
    else:
        with offload:
            loss = model(x).square().mean()
    loss.backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in model.parameters()], torch.cuda.max_memory_allocated()


def test_offload_on_gpu_is_bitwise_equal_with_a_lower_peak(tmp_path):
    model = deep_mlp()
    x = torch.randn(8192, 1024, device="cuda")  # 32 MiB a saved tensor, 12 of them a step
    one_step(model, x, None)  # warm-up: cuBLAS workspaces
    ref, peak_ref = one_step(model, x, None)
    offload = save_on_disk(threshold_bytes=MiB, directory=tmp_path)
    try:
        one_step(model, x, offload)  # warm-up: pinned buffers, side stream
        got, peak = one_step(model, x, offload)
        stats = offload.stats()
    finally:
        offload.close()
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert stats.bytes_written > 0 and stats.bytes_read > 0
    # Most of the 11 activations after the input (352 MiB) leave the device for the step.
    assert peak < peak_ref - 150 * MiB, (peak / MiB, peak_ref / MiB)
    assert os.listdir(tmp_path) == []


def test_offload_on_gpu_refuses_a_tensor_changed_in_place(tmp_path):
    offload = save_on_disk(threshold_bytes=1024, directory=tmp_path)
    try:
        x = torch.randn(512, 256, device="cuda", requires_grad=True)
        with offload:
            y = x.sigmoid()  # sigmoid saves its output, y; the product saves y too
            z = (y * 2).sum()
        offload.flush()
        assert offload.stats().bytes_written > 0  # y went to disk
        with torch.no_grad():
            y.add_(1)  # changed in place after it was saved
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.backward()
    finally:
        offload.close()
    assert os.listdir(tmp_path) == []


def test_fifty_logged_offloaded_steps_grow_neither_memory_nor_files(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    (tmp_path / "off").mkdir()
    model = deep_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(2048, 1024, device="cuda")
    writer = SummaryWriter(str(tmp_path / "logs"))
    monitor, log = GradientMonitor(model), GradientLog(writer, optimizers=[optimizer], echo=None)
    offload = save_on_disk(threshold_bytes=MiB, directory=tmp_path / "off")
    allocated, files = [], []
    try:
        with monitor.attach():
            for step in range(50):
                monitor.arm()
                with offload:
                    loss = model(x).square().mean()
                loss.backward()
                log.write(monitor.collect(), step)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del loss
                offload.flush()
                torch.cuda.synchronize()
                allocated.append(torch.cuda.memory_allocated())
                files.append((offload.stats().files_on_disk, len(os.listdir(tmp_path / "logs"))))
        log.close()
    finally:
        offload.close()
        writer.close()
    assert abs(allocated[-1] - allocated[4]) <= MiB, [a // MiB for a in allocated]  # steady from the 5th step on
    assert set(files[4:]) == {(0, 2)}  # no offload file open after a step; two event files, ever
    assert os.listdir(tmp_path / "off") == []
