"""Offload under a memory budget: ``save_on_disk(budget_bytes=B)`` keeps the newest
offloadable saves in memory and writes the oldest; the engine never holds more than B plus one
tensor; results stay bitwise equal; the disk-space warning; the callback argument."""

from __future__ import annotations

import errno
import gc
import os
import threading
import time
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lightning_gradhooks import GradHooks
from lightning_gradhooks.offload import reader, segments, writer  # their I/O calls are patched below
from lightning_gradhooks.offload import DiskOffloadError, save_on_disk

from conftest import MLP, GradRecorder, loader, make_trainer
from test_offload import batch, files, mlp, train_step

MiB = 1 << 20
SAVED = 12 * MiB  # mlp(depth=6) on batch(): 6 Linear inputs + 6 GELU inputs of 1 MiB each


def saved_bytes(tmp_path: Path) -> int:
    e = save_on_disk(threshold_bytes=MiB, directory=tmp_path)
    with e:
        loss = mlp(depth=6)(batch()).sum()
    e.flush()
    n = e.stats().bytes_offloaded
    loss.backward()
    e.close()
    return n


def test_the_workload_saves_what_the_tests_assume(tmp_path: Path) -> None:
    assert saved_bytes(tmp_path) == SAVED


@pytest.mark.parametrize("budget_mib", [1, 3, 6, 9, 12, 20])
def test_bytes_written_are_bytes_saved_minus_the_budget(tmp_path: Path, budget_mib: int) -> None:
    budget = budget_mib * MiB
    e = save_on_disk(threshold_bytes=MiB, directory=tmp_path, budget_bytes=budget)
    model, x = mlp(depth=6), batch()
    for step in range(1, 4):
        with e:
            loss = model(x).sum()
        e.flush()
        s = e.stats()
        # The newest stay: what was written is what the budget could not hold, give or take the
        # one tensor of room kept for the next write. The batch is not counted (the test holds it).
        assert max(0, SAVED - MiB - budget) <= s.bytes_offloaded / step <= max(0, SAVED - budget)
        assert s.bytes_written == s.bytes_offloaded and s.bytes_parked == SAVED - s.bytes_offloaded / step
        loss.backward()
        assert e.stats().bytes_parked == 0  # backward freed the graph: nothing held
    e.close()


@pytest.mark.parametrize("budget_mib", [1, 2, 5, 8])
@pytest.mark.parametrize("prefetch_mib", [0, 4, 32])
def test_never_holds_more_than_the_budget_plus_one_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          budget_mib: int, prefetch_mib: int) -> None:
    # A slow disk. Its first write waits until the forward has seen bytes held: under a 1 MiB budget
    # those are only writes in flight, which a 5 ms delay alone lets end before the layer's hook once
    # the op between them (the save comes before the op) takes longer on a loaded machine. A hook that
    # never sees any lets the writes go after 10 s, and the test fails below.
    real, looked = writer.pwrite_all, threading.Event()

    def slow_disk(*args: object) -> None:
        if not looked.wait(timeout=10):
            looked.set()
        time.sleep(0.005)
        real(*args)

    monkeypatch.setattr(writer, "pwrite_all", slow_disk)
    budget = budget_mib * MiB
    e = save_on_disk(threshold_bytes=MiB, directory=tmp_path, budget_bytes=budget, prefetch_bytes=prefetch_mib * MiB)
    model, x = mlp(depth=8), batch()
    seen: list[int] = []

    def look(m: torch.nn.Module, i: object, o: object) -> None:  # what the engine holds as the forward goes
        seen.append(e.stats().bytes_in_memory)
        if seen[-1] > 0:
            looked.set()

    for layer in model:
        layer.register_forward_hook(look)
    for _ in range(2):
        with e:
            loss = model(x).sum()
        loss.backward()
    s = e.stats()
    assert s.bytes_written > 0 and s.bytes_read <= s.bytes_written  # some were still being written: from memory
    assert 0 < max(seen) <= s.bytes_in_memory_peak <= budget + MiB  # the high-water mark, forward and backward
    assert s.budget_bytes == budget and s.bytes_in_memory == 0
    e.close()


@pytest.mark.parametrize("budget_mib", [1, 6, 11, 100])
def test_budget_is_bitwise_identical_with_retain_graph(tmp_path: Path, budget_mib: int) -> None:
    e = save_on_disk(threshold_bytes=64 << 10, directory=tmp_path, budget_bytes=budget_mib * MiB)
    model, x = mlp(), batch()
    ref = train_step(model, x, None)
    for _ in range(2):
        got = train_step(model, x, e)
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert e.stats().files_on_disk == 0 and e.stats().bytes_in_memory == 0
    e.close()


def test_backward_starts_from_memory_and_reads_ahead_the_newest_written(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[tuple[int, str]] = []
    real = reader.pread_all

    def spy(fd: int, data: memoryview, off: int, *rest: int) -> None:
        reads.append((off, threading.current_thread().name))
        real(fd, data, off, *rest)

    monkeypatch.setattr(reader, "pread_all", spy)
    e = save_on_disk(threshold_bytes=MiB, directory=tmp_path, budget_bytes=6 * MiB)
    model, x = mlp(depth=6), batch()
    with e:
        loss = model(x).sum()
    e.flush()
    loss.backward()
    assert reads and [off for off, _ in reads] == sorted((off for off, _ in reads), reverse=True)
    assert all(name == "save_on_disk-reader" for _, name in reads)  # read ahead, never by the training thread
    assert e.stats().bytes_read == e.stats().bytes_written
    e.close()


def test_inplace_change_of_a_tensor_kept_under_the_budget_raises(tmp_path: Path) -> None:
    e = save_on_disk(threshold_bytes=1, directory=tmp_path, budget_bytes=1 << 30)
    x = torch.randn(256, 256, requires_grad=True)
    with e:
        y = x.sigmoid()
        z = (y * 2).sum()
    assert e.stats().bytes_parked > 0 and e.stats().bytes_offloaded == 0
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()
    e.close()


def test_write_failure_drops_what_the_step_kept_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: memoryview, off: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer, "pwrite_all", full)
    e = save_on_disk(threshold_bytes=MiB, directory=tmp_path, budget_bytes=4 * MiB)
    model, x = mlp(depth=8), batch()
    with pytest.raises(DiskOffloadError) as info:
        with e:
            model(x).sum().backward()
    assert info.value.errno == errno.ENOSPC
    del info
    gc.collect()
    assert files(e) == [] and e.stats().bytes_in_memory == 0 and e.stats().bytes_parked == 0
    monkeypatch.undo()
    ref = train_step(model, x, None)
    assert all(torch.equal(a, b) for a, b in zip(ref, train_step(model, x, e), strict=True))
    e.close()


def test_without_a_budget_everything_is_written_and_writes_in_flight_are_bounded(tmp_path: Path) -> None:
    e = save_on_disk(threshold_bytes=MiB, directory=tmp_path)
    assert e._engine.spill.max_in_flight == 32 * MiB  # the default: see docs/offload.md
    with e:
        loss = mlp(depth=6)(batch()).sum()
    e.flush()
    s = e.stats()
    assert s.bytes_offloaded == SAVED and s.bytes_parked == 0 and s.budget_bytes is None
    loss.backward()
    e.close()


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "1"])
def test_bad_budget_is_refused_at_construction(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match="`budget_bytes` expected a positive int or None, got"):
        save_on_disk(threshold_bytes=MiB, directory=tmp_path, budget_bytes=value)


# ---------------------------------------------------------------------------- disk space


def test_warns_before_enospc_at_setup_and_after_the_first_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    free = {"bytes": 1 << 40}
    monkeypatch.setattr(segments, "free_bytes", lambda fd: free["bytes"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # plenty of room: no warning
        e = save_on_disk(threshold_bytes=MiB, directory=tmp_path)
        with e:
            loss = mlp(depth=6)(batch()).sum()
        loss.backward()
    free["bytes"] = 8 * MiB  # with this step's own file (<= 12 MiB): less than two steps of 12 MiB
    with pytest.warns(UserWarning) as record:
        with e:
            loss = mlp(depth=6)(batch()).sum()
        loss.backward()
        with e:  # once only
            loss = mlp(depth=6)(batch()).sum()
        loss.backward()
    [w] = [w for w in record if "save_on_disk" in str(w.message)]
    message = str(w.message)
    assert str(tmp_path) in message and "free" in message and str(2 * SAVED) in message and "ENOSPC" in message
    assert w.filename == __file__  # points at the user's `with`
    e.close()
    free["bytes"] = MiB  # a nearly full folder is told at setup already
    with pytest.warns(UserWarning, match=f"{tmp_path}.*free.*{2 * 32 * MiB} bytes needed"):
        save_on_disk(threshold_bytes=MiB, directory=tmp_path).close()


# ---------------------------------------------------------------------------- the callback


@pytest.mark.parametrize("kwargs, match", [
    (dict(offload_threshold_bytes=256, offload_budget_bytes=0), "offload_budget_bytes"),
    (dict(offload_threshold_bytes=256, offload_budget_bytes=-5), "offload_budget_bytes"),
    (dict(offload_threshold_bytes=256, offload_budget_bytes=2.5), "offload_budget_bytes"),
    (dict(offload_threshold_bytes=256, offload_budget_bytes=True), "offload_budget_bytes"),
    (dict(offload_budget_bytes=1024), "offload_threshold_bytes"),
])
def test_callback_refuses_bad_budgets_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GradHooks(**kwargs)


def test_callback_budget_trains_bitwise_identically(tmp_path: Path) -> None:
    runs = []
    for budget in (None, 1024):
        pl.seed_everything(0, verbose=False)
        model = MLP()
        kwargs = {} if budget is None else dict(offload_threshold_bytes=256, offload_budget_bytes=budget,
                                                offload_dir=str(tmp_path))
        callback, grads = GradHooks(every_n_steps=2, **kwargs), GradRecorder()
        make_trainer(tmp_path, [callback, grads]).fit(model, loader())
        runs.append((torch.stack(model.losses), grads.grads, callback.offload_stats))
    (loss_a, grads_a, _), (loss_b, grads_b, stats) = runs
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for sa, sb in zip(grads_a, grads_b) for a, b in zip(sa, sb))
    assert stats.budget_bytes == 1024 and stats.bytes_written > 0 and stats.bytes_in_memory_peak <= 1024 + 512


MALLOPT_SCRIPT = """
import ctypes, json, logging, sys, tempfile
import torch
from lightning_gradhooks.offload import _memory, save_on_disk
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
def step(offload):
    with offload:
        loss = model(torch.randn(512, 64)).sum()
    loss.backward()
seen = {}
off = save_on_disk(1 << 14, tempfile.gettempdir(), fix_mmap_threshold=False)
step(off); off.close()
seen["off"] = _memory._mmap_threshold
on = save_on_disk(1 << 14, tempfile.gettempdir())
seen["made"] = _memory._mmap_threshold  # nothing yet: the device of the activations is not known
step(on); step(on); on.close()
seen["used"] = _memory._mmap_threshold
again = save_on_disk(1 << 14, tempfile.gettempdir())
step(again); again.close()
seen["glibc"] = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
seen["clamp"] = []
for asked in (64 << 20, 1):
    _memory.fix_mmap_threshold(asked)
    seen["clamp"].append(_memory._mmap_threshold)
print(json.dumps(seen))
"""


def mallopt_run(**env: str) -> tuple[dict, str]:
    import json
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    environ["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, "-c", MALLOPT_SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**environ, **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_the_mmap_threshold_is_set_at_the_first_cpu_tensor_offloaded_said_once_and_can_be_left_alone() -> None:
    """In a fresh process: fix_mmap_threshold=False never touches the allocator; by default the
    threshold is set at the first CPU tensor offloaded (not when the engine is made), with one
    INFO line for the process; clamped to 1-32 MiB and never raised."""
    seen, err = mallopt_run()
    assert seen["off"] is None and seen["made"] is None
    lines = [line for line in err.splitlines() if line.startswith("lightning_gradhooks.offload INFO")]
    if not seen["glibc"]:
        assert seen["used"] is None and lines == []
        return
    assert seen["used"] == MiB  # threshold_bytes = 16 KiB, clamped to glibc's useful range
    assert len(lines) == 1 and "mmap threshold to 1048576 bytes" in lines[0] and "fix_mmap_threshold=False" in lines[0]
    assert seen["clamp"] == [MiB, MiB]  # never raised, and not below 1 MiB


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "4194304"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4194304"}])
def test_the_users_own_mmap_threshold_stands(env: dict[str, str]) -> None:
    seen, err = mallopt_run(**env)
    assert seen["used"] is None and seen["clamp"] == [None, None] and "mmap threshold" not in err