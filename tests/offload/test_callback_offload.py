"""GradHooks with disk offload: every training step offloaded, nothing else, nothing left behind."""

import os
import time

import pytest
import pytorch_lightning as pl
import torch

from lightning_gradhooks import GradHooks
from lightning_gradhooks.offload import DiskOffloadError

from conftest import MLP, FailingBackward, GradRecorder, ManualGAN, hook_snapshot, loader, make_trainer
from test_offload import open_files

THRESHOLD = 256  # bytes: the MLP's activations (8 x 16 floats = 512 bytes) go to disk


def saved_tensors_hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class OffloadProbe(pl.Callback):
    """Records the engine's counters after each backward and whether hooks are on in eval loops."""

    def __init__(self, gradhooks: GradHooks) -> None:
        self.gradhooks = gradhooks
        self.written: list[int] = []
        self.in_validation: list[bool] = []
        self.folder = None
        self.open_files: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001
        engine = self.gradhooks.offload
        self.folder = engine.directory
        # Backward may have read a tensor from memory while the writer was still writing it;
        # the file closes when that write ends (on a loaded machine, after backward).
        deadline = time.monotonic() + 10
        while engine.stats().bytes_pending_write and time.monotonic() < deadline:
            time.sleep(0.001)
        stats = engine.stats()
        self.written.append(stats.bytes_offloaded)
        self.open_files.append(stats.files_on_disk)  # the step's graph is freed: its file is closed

    def on_validation_batch_start(self, *args):  # noqa: ANN002
        self.in_validation.append(saved_tensors_hooks_active())


def files_under(path) -> list[str]:  # noqa: ANN001
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def offload_dir(tmp_path) -> str:  # noqa: ANN001
    folder = tmp_path / "off"
    folder.mkdir(exist_ok=True)
    return str(folder)


def test_offloaded_training_is_bitwise_identical_and_leaves_nothing(tmp_path):
    runs = []
    for threshold in (None, THRESHOLD):
        pl.seed_everything(0, verbose=False)
        model = MLP()
        callback = GradHooks(every_n_steps=2, offload_threshold_bytes=threshold,
                             offload_dir=offload_dir(tmp_path) if threshold else None)
        probe, grads = OffloadProbe(callback), GradRecorder()
        callbacks = [callback, grads] + ([probe] if threshold else [])
        make_trainer(tmp_path, callbacks, val_check_interval=3).fit(model, loader(), loader(16))
        runs.append((torch.stack(model.losses), grads.grads))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for sa, sb in zip(grads_a, grads_b) for a, b in zip(sa, sb))
    # Every step handed its activations to the engine; validation ran without the hooks.
    assert len(probe.written) == 6 and all(b > a for a, b in zip([0] + probe.written, probe.written))
    assert probe.in_validation and not any(probe.in_validation)
    assert probe.folder == str(tmp_path / "off") and probe.open_files == [0] * 6  # nothing left from earlier steps
    assert files_under(tmp_path / "off") == [] and open_files(tmp_path / "off") == []
    assert not saved_tensors_hooks_active()


def test_exception_in_training_step_leaves_no_files_and_no_hooks(tmp_path):
    model = MLP(fail_at=3)
    before = hook_snapshot(model)
    callback = GradHooks(offload_threshold_bytes=THRESHOLD, offload_dir=offload_dir(tmp_path))
    with pytest.raises(RuntimeError, match="boom in training_step"):
        make_trainer(tmp_path, [callback]).fit(model, loader())
    assert files_under(tmp_path / "off") == []
    assert not saved_tensors_hooks_active()
    assert hook_snapshot(model) == before


class FailsInBackward(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return FailingBackward.apply(out) if self.global_step == 2 else out


def test_exception_in_backward_leaves_no_files(tmp_path):
    callback = GradHooks(offload_threshold_bytes=THRESHOLD, offload_dir=offload_dir(tmp_path))
    with pytest.raises(RuntimeError, match="boom in backward"):
        make_trainer(tmp_path, [callback]).fit(FailsInBackward(), loader())
    assert files_under(tmp_path / "off") == []
    assert not saved_tensors_hooks_active()


def test_manual_optimization_runs_offloaded(tmp_path):
    model = ManualGAN(probe=saved_tensors_hooks_active)
    callback = GradHooks(offload_threshold_bytes=THRESHOLD, offload_dir=offload_dir(tmp_path))
    make_trainer(tmp_path, [callback], max_steps=6).fit(model, loader())
    assert model.saved_inside and all(model.saved_inside)
    assert files_under(tmp_path / "off") == []


@pytest.mark.parametrize("name, reason", [("a_file", "Not a directory"), ("missing", "No such file or directory")])
def test_unusable_offload_dir_fails_before_the_first_step(tmp_path, name, reason):
    (tmp_path / "a_file").write_text("not a folder")
    model = MLP(fail_at=0)  # would raise "boom" if a step ran
    callback = GradHooks(offload_threshold_bytes=THRESHOLD, offload_dir=str(tmp_path / name))
    with pytest.raises(DiskOffloadError, match=f"expected an existing folder, got .*{name}.*{reason}"):
        make_trainer(tmp_path, [callback]).fit(model, loader())
    assert model.losses == [] and not (tmp_path / "missing").exists()  # never created


class PidDataset(torch.utils.data.Dataset):
    """Each sample carries the pid of the process that loaded it."""

    def __init__(self) -> None:
        self.x, self.y = loader().dataset.tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):  # noqa: ANN204
        return self.x[i], self.y[i], torch.tensor(os.getpid())


class PidMLP(MLP):
    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y, pids = batch
        self.workers = getattr(self, "workers", set()) | set(pids.tolist())
        return super().training_step((x, y), batch_idx)

    def on_before_backward(self, loss):  # noqa: ANN001
        # The step's file is open here: the parent holds it, the workers must not.
        self.gradhooks.offload.flush()
        held = [f for pid in sorted(self.workers) for f in open_files(self.offload_folder, pid)]
        self.held = getattr(self, "held", []) + [(len(open_files(self.offload_folder)), held)]


def test_persistent_dataloader_workers_hold_no_offload_file(tmp_path):
    model = PidMLP()
    model.offload_folder = offload_dir(tmp_path)
    data = torch.utils.data.DataLoader(PidDataset(), batch_size=8, num_workers=2, persistent_workers=True)
    callback = GradHooks(offload_threshold_bytes=THRESHOLD, offload_dir=model.offload_folder)
    model.gradhooks = callback
    make_trainer(tmp_path, [callback], max_steps=12).fit(model, data)  # two epochs, the same workers
    assert len(model.workers) == 2 and os.getpid() not in model.workers
    assert model.held == [(1, [])] * 12
    assert open_files(model.offload_folder) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(offload_threshold_bytes=0), "`offload_threshold_bytes` expected a positive int or None, got 0"),
        (dict(offload_threshold_bytes="1M"), "`offload_threshold_bytes` expected a positive int or None, got '1M'"),
        (dict(offload_threshold_bytes=1, offload_dir=3), "`offload_dir` expected a str or None, got 3"),
        (dict(offload_dir="/tmp"), "`offload_dir` expected `offload_threshold_bytes` to be set too"),
        (dict(offload_threshold_bytes=1, offload_dir=""), "`offload_dir` expected a non-empty path without NUL"),
        (dict(offload_threshold_bytes=1, offload_dir="/tmp/a\0b"), "`offload_dir` expected a non-empty path"),
        (dict(histogram_bins=10**30), "`histogram_bins` expected an int from 1 to 4096, got 10000000000000000000000000000"),
        (dict(histogram_bins=3_000_000), "`histogram_bins` expected an int from 1 to 4096, got 3000000"),
        (dict(include=5), r"`include` expected a non-empty list of glob patterns \(str\) or None, got 5"),
        (dict(exclude=5), r"`exclude` expected a list of glob patterns \(str\) or None, got 5"),
    ],
)
def test_invalid_offload_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradHooks(**kwargs)


GRADHOOKS_MALLOPT = """
import logging, sys
import pytorch_lightning as pl
from lightning_gradhooks import GradHooks
from lightning_gradhooks.offload import _memory
from conftest import MLP, loader
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
seen = []
for fix in (False, True):
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[GradHooks(offload_threshold_bytes=256, offload_fix_mmap_threshold=fix,
                                              compile_statistics=False)])
    trainer.fit(MLP(), loader())
    seen.append(_memory._mmap_threshold)
print("thresholds", seen)
"""


def test_offload_fix_mmap_threshold_false_leaves_the_allocator_alone():
    """In a fresh process: offload_fix_mmap_threshold=False reaches the engine (the allocator is not
    touched); the default sets the threshold, said in one INFO line."""
    import ctypes
    import subprocess
    import sys

    with pytest.raises(ValueError, match=r"`offload_fix_mmap_threshold` expected a bool \(True or False\), got 1"):
        GradHooks(offload_threshold_bytes=256, offload_fix_mmap_threshold=1)
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, "-c", GRADHOOKS_MALLOPT], capture_output=True, text=True, env=env,
                          timeout=300, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr[-3000:]
    glibc = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
    assert f"thresholds [None, {1 << 20 if glibc else None}]" in done.stdout
    info = [line for line in done.stderr.splitlines() if line.startswith("lightning_gradhooks.offload INFO")]
    assert len(info) == (1 if glibc else 0)
