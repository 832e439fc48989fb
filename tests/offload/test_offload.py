"""Tests for the disk offload engine ``save_on_disk`` (CPU; CUDA tests skip without a GPU)."""

from __future__ import annotations

import errno
import gc
import itertools
import os
import pickle
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_gradhooks.offload import reader, records, writer  # their I/O calls are patched below
from lightning_gradhooks.offload import DiskOffloadError, save_on_disk

from conftest import FailingBackward
from test_offload_signals import free_bytes, mounted_tmpfs, tmpfs  # noqa: F401 - a fixture

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def mlp(depth: int = 4, width: int = 256, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])


def batch(n: int = 1024, width: int = 256) -> torch.Tensor:  # 1 MiB per activation by default
    return torch.randn(n, width, generator=torch.Generator().manual_seed(1))


class Keep(torch.autograd.Function):
    """Identity that saves its inputs and records what backward unpacks from them."""

    unpacked: list[tuple[torch.Tensor, ...]] = []

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(*xs)
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        Keep.unpacked.append(ctx.saved_tensors)
        Keep.unpacked.append(ctx.saved_tensors)  # unpacking twice gives the same data
        return (grad,) + (None,) * len(ctx.saved_tensors)


def roundtrip(engine: save_on_disk, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Save ``xs`` under ``engine``, wait until they are on disk, run backward, return what came back."""
    anchor = torch.zeros(1, requires_grad=True)
    Keep.unpacked.clear()
    with engine:
        out = Keep.apply(anchor, *xs)
    engine.flush()
    out.sum().backward()
    first, second = Keep.unpacked
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    return first


@pytest.fixture
def engine(tmp_path: Path):
    e = save_on_disk(threshold_bytes=64 << 10, directory=tmp_path)
    yield e
    e.close()


def open_files(folder: str | Path, pid: int | str = "self") -> list[str]:
    """The files in ``folder`` that process ``pid`` holds open (unnamed ones read ``folder/#ino (deleted)``)."""
    prefix, found = os.path.join(str(folder), ""), []
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:  # closed meanwhile
            continue
        if target.startswith(prefix):
            found.append(target)
    return found


def files(e: save_on_disk) -> list[str]:
    """What the engine keeps open in its folder, once its reader thread has caught up."""
    e.stats()  # waits until every dead handle was handled (and its file closed)
    return open_files(e.directory)


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


# ---------------------------------------------------------------------------- memory


def test_memory_released_during_forward(tmp_path: Path) -> None:
    model, x = mlp(depth=6), batch()
    e = save_on_disk(threshold_bytes=MiB, directory=tmp_path)
    refs: list[StorageWeakRef] = []
    for layer in model:
        layer.register_forward_hook(lambda m, i, o: refs.append(StorageWeakRef(o.untyped_storage())))
    with e:
        loss = model(x).sum()
    e.flush()
    gc.collect()
    s = e.stats()
    assert s.bytes_in_memory == 0 and s.bytes_pending_write == 0
    assert s.bytes_written >= 12 * MiB and s.bytes_on_disk >= s.bytes_written and s.files_on_disk == 1
    assert len(refs) == 12 and sum(not r.expired() for r in refs) == 0  # all activations freed
    loss.backward()
    e.close()


def test_without_offload_activations_stay_alive() -> None:  # the check above can fail
    model, x = mlp(depth=6), batch()
    refs: list[StorageWeakRef] = []
    for layer in model:
        layer.register_forward_hook(lambda m, i, o: refs.append(StorageWeakRef(o.untyped_storage())))
    loss = model(x).sum()
    assert len(refs) == 12 and sum(not r.expired() for r in refs) == 11  # all but the summed output
    loss.backward()


def test_backpressure_bounds_bytes_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = writer.pwrite_all
    monkeypatch.setattr(writer, "pwrite_all", lambda *a: gate.wait(20) and real(*a))  # a stalled disk
    e = save_on_disk(threshold_bytes=MiB, directory=tmp_path, max_bytes_in_flight=2 * MiB)
    model, x = mlp(depth=4), batch()
    seen: list[int] = []
    for layer in model:
        layer.register_forward_hook(lambda m, i, o: seen.append(e.stats().bytes_pending_write))
    losses: list[torch.Tensor] = []

    def forward() -> None:
        with e:  # hooks are per thread
            losses.append(model(x).sum())

    worker = threading.Thread(target=forward)
    worker.start()
    for _ in range(500):
        if e.stats().bytes_pending_write == 2 * MiB:
            break
        threading.Event().wait(0.01)
    worker.join(0.3)
    assert worker.is_alive() and e.stats().bytes_pending_write == 2 * MiB  # the forward waits for the disk
    gate.set()
    worker.join(20)
    assert not worker.is_alive() and len(losses) == 1 and 0 < max(seen) <= 2 * MiB
    losses[0].backward()
    e.close()


# ---------------------------------------------------------------------------- correctness


def train_step(model: nn.Module, x: torch.Tensor, ctx: save_on_disk | None) -> list[torch.Tensor]:
    model.zero_grad()
    if ctx is None:
        loss = model(x).square().mean()
    else:
        with ctx:
            loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    first = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    if ctx is not None:
        ctx.flush()  # everything on disk: the second backward reads it all back
    loss.backward()  # second backward on the retained graph
    return first + [p.grad.clone() for p in model.parameters()]


def test_bitwise_identical_and_retain_graph(engine: save_on_disk) -> None:
    model, x = mlp(), batch()
    ref = train_step(model, x, None)
    for _ in range(3):  # one engine, several steps
        got = train_step(model, x, engine)
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
        assert engine.stats().files_on_disk == 0
    engine.flush()
    s = engine.stats()
    assert s.bytes_written > 0 and s.bytes_read > 0  # really went through the disk


def test_double_backward(engine: save_on_disk) -> None:
    model, x = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh()), batch()

    def penalty(ctx: save_on_disk | None) -> list[torch.Tensor]:
        model.zero_grad()
        with ctx if ctx is not None else torch.enable_grad():
            out = model(x).square().sum()
        grads = torch.autograd.grad(out, list(model.parameters()), create_graph=True)
        total = sum(g.square().sum() for g in grads)
        total.backward()
        return [total.detach()] + [p.grad.clone() for p in model.parameters()]

    ref = penalty(None)
    got = penalty(engine)
    assert engine.stats().bytes_read > 0
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                                   torch.bool, torch.complex64, torch.float64])
def test_dtype_shape_stride_roundtrip(engine: save_on_disk, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    def make(*shape: int) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.rand(*shape, generator=g) > 0.5
        if dtype.is_complex:
            return torch.randn(*shape, dtype=dtype, generator=g)
        return (torch.randn(*shape, generator=g) * 100).to(dtype)

    base = make(3, 256, 320)
    views = [base[1].t(), make(300, 300)[5:, 7:290], base.permute(2, 0, 1), make(1, 1 << 16).expand(3, 1 << 16)]
    for v in views:
        (back,) = roundtrip(engine, v)
        assert back.dtype == v.dtype and back.shape == v.shape and back.stride() == v.stride()
        assert back.storage_offset() >= 0 and torch.equal(back, v)
        assert back.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()  # read from disk


def test_views_of_one_storage_written_once(engine: save_on_disk) -> None:
    base = torch.randn(512, 512)  # 1 MiB
    a, b, c = base, base.t(), base[64:]
    before = engine.stats().bytes_written
    ra, rb, rc = roundtrip(engine, a, b, c)
    s = engine.stats()
    assert s.bytes_written - before == base.untyped_storage().nbytes()
    assert s.tensors_deduplicated == 2
    assert torch.equal(ra, a) and torch.equal(rb, b) and torch.equal(rc, c) and rb.stride() == (1, 512)
    assert ra.untyped_storage().data_ptr() == rb.untyped_storage().data_ptr() == rc.untyped_storage().data_ptr()


def test_small_view_of_large_storage_writes_only_its_region(engine: save_on_disk) -> None:
    base = torch.randn(1024, 1024)  # 4 MiB
    v = base[100:200]  # 400 KiB
    (back,) = roundtrip(engine, v)
    assert engine.stats().bytes_written == v.numel() * 4 and torch.equal(back, v)


def test_parameters_and_small_tensors_not_written(engine: save_on_disk) -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 4 MiB weights
    x = torch.randn(32, 1024)  # 128 KiB activations
    with engine:
        loss = model(x).sum()
    assert engine.stats().bytes_offloaded == 2 * x.numel() * 4  # x and the hidden activation; no weight
    engine.flush()
    loss.backward()
    s = engine.stats()
    assert s.bytes_written == 2 * x.numel() * 4
    assert s.tensors_kept >= 1  # weight.t() of the second layer, a view of a parameter
    roundtrip(engine, torch.randn(8, 8))  # below the threshold
    assert engine.stats().bytes_written == 2 * x.numel() * 4
    leaf = torch.randn(512, 512, requires_grad=True)  # 1 MiB leaves: saved directly by mul
    with engine:
        loss = (leaf * leaf.exp()).sum()
    engine.flush()
    loss.backward()
    assert engine.stats().bytes_written == 2 * x.numel() * 4 + leaf.numel() * 4  # only leaf.exp()


def test_keep_in_memory_buffers(engine: save_on_disk) -> None:
    class Proj(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("basis", torch.randn(512, 512))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.basis  # saves the buffer for the input gradient

    proj, x = Proj(), torch.randn(8, 512, requires_grad=True)
    with engine:
        proj(x).sum().backward()
    assert engine.stats().bytes_offloaded == proj.basis.numel() * 4
    engine.keep_in_memory(proj)
    with engine:
        proj(x).sum().backward()
    assert engine.stats().bytes_offloaded == proj.basis.numel() * 4


def test_in_place_change_before_write_is_an_error(engine: save_on_disk, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = writer.pwrite_all
    monkeypatch.setattr(writer, "pwrite_all", lambda *a: gate.wait(10) and real(*a))
    x = torch.randn(256, 256, requires_grad=True)
    with engine:
        y = x * 2
        z = y.exp()  # saves y... no: saves the result z
        z.mul_(1)  # in-place change of a saved tensor
    gate.set()
    with pytest.raises(RuntimeError, match="in-place"):
        z.sum().backward()


# ---------------------------------------------------------------------------- safety


def test_files_have_no_name_mode_0600_raw_bytes(engine: save_on_disk, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*a: object, **k: object) -> None:
        raise AssertionError("unpickling is forbidden")

    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    assert engine.directory == str(tmp_path)
    x = torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)
    anchor = torch.zeros(1, requires_grad=True)
    with engine:
        out = Keep.apply(anchor, x)
    engine.flush()
    assert os.listdir(tmp_path) == []  # nothing has a name, even mid-step
    (target,) = files(engine)
    assert target.endswith("(deleted)") or "/#" in target
    (seg,) = engine._engine.segments.by_index.values()
    st = os.fstat(seg.fd)
    assert st.st_nlink == 0 and stat.S_IMODE(st.st_mode) == 0o600
    assert os.pread(seg.fd, x.numel() * 4, 0) == x.numpy().tobytes()  # raw data, no header, no pickle
    out.sum().backward()
    assert files(engine) == [] and engine.stats().files_on_disk == 0


def test_o_tmpfile_where_linux_offers_it(engine: save_on_disk) -> None:
    if sys.platform == "linux" and hasattr(os, "O_TMPFILE"):
        assert engine._engine.tmpfile  # ext4, xfs, btrfs, tmpfs


def test_fallback_create_then_unlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)  # as on macOS or an old kernel
    e = save_on_disk(threshold_bytes=64 << 10, directory=tmp_path)
    assert not e._engine.tmpfile
    model, x = mlp(), batch()
    ref = train_step(model, x, None)
    with e:
        loss = model(x).sum()
    e.flush()
    assert os.listdir(tmp_path) == [] and len(files(e)) == 1  # unlinked at once
    del loss
    assert all(torch.equal(a, b) for a, b in zip(ref, train_step(model, x, e), strict=True))
    assert files(e) == []
    e.close()


def test_default_directory_is_the_temporary_folder() -> None:
    e = save_on_disk(threshold_bytes=0)
    try:
        assert e.directory == os.path.abspath(tempfile.gettempdir())
    finally:
        e.close()


def test_space_used_while_nothing_is_visible(tmpfs: Path) -> None:
    e = save_on_disk(threshold_bytes=MiB, directory=tmpfs)
    free = free_bytes(tmpfs)
    model, x = mlp(depth=6), batch()
    with e:
        loss = model(x).sum()
    e.flush()
    written = e.stats().bytes_on_disk
    assert written >= 12 * MiB and os.listdir(tmpfs) == []
    assert 0.9 * written <= free - free_bytes(tmpfs) <= written + MiB
    loss.backward()
    e.stats()
    assert free_bytes(tmpfs) >= free - (64 << 10)  # closed as soon as the graph was freed
    e.close()


def test_no_files_after_exception_in_forward(engine: save_on_disk) -> None:
    model, x = mlp(), batch()
    with pytest.raises(ValueError, match="boom"):
        with engine:
            h = model(x)
            engine.flush()
            assert len(files(engine)) == 1
            raise ValueError("boom")
    del h
    gc.collect()
    assert files(engine) == [] and engine.stats().bytes_in_memory == 0


def test_no_files_after_exception_in_backward(engine: save_on_disk) -> None:
    model, x = mlp(), batch()
    with engine:
        loss = model[4:](FailingBackward.apply(model[:4](x))).sum()  # fails halfway through backward
    engine.flush()
    assert len(files(engine)) == 1
    with pytest.raises(RuntimeError, match="boom in backward"):
        loss.backward()
    del loss
    gc.collect()
    assert files(engine) == []


def test_files_follow_graph_lifetime(engine: save_on_disk) -> None:
    model, x = mlp(), batch()
    with engine:
        loss1 = model(x).sum()
    with engine:
        loss2 = model(x).sum()
    engine.flush()
    assert len(files(engine)) == 2
    del loss1
    assert len(files(engine)) == 1
    loss2.backward()
    assert files(engine) == []


def test_close_removes_everything(tmp_path: Path) -> None:
    e = save_on_disk(threshold_bytes=MiB, directory=tmp_path)
    model, x = mlp(), batch()
    with e:
        loss = model(x).sum()
    e.flush()
    assert len(open_files(tmp_path)) == 1
    e.close()
    e.close()  # idempotent
    assert open_files(tmp_path) == [] and os.listdir(tmp_path) == []
    assert str(tmp_path) not in [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                                 if os.path.exists(f"/proc/self/fd/{fd}")]  # the folder's descriptor too
    with pytest.raises(RuntimeError, match="closed"):
        loss.backward()
    with pytest.raises(RuntimeError, match="closed"):
        e.__enter__()


def test_forked_child_closes_its_copies_parent_keeps_its_files(engine: save_on_disk) -> None:
    model, x = mlp(), batch()
    ref = train_step(model, x, None)
    model.zero_grad()
    with engine:
        loss = model(x).square().mean()
    engine.flush()
    pid = os.fork()
    if pid == 0:  # the child holds none of the files, drops the graph, then leaves without cleanup
        code = 1
        try:
            held = open_files(engine.directory)
            del loss
            gc.collect()
            code = 0 if held == [] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(files(engine)) == 1
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(ref[1:5], model.parameters()))
    assert files(engine) == []


class Pids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(os.getpid())


def test_dataloader_workers_forked_mid_step_hold_no_file(engine: save_on_disk) -> None:
    model, x = mlp(), batch()
    with engine:
        loss = model(x).sum()
    engine.flush()
    assert len(files(engine)) == 1
    loader = torch.utils.data.DataLoader(Pids(), batch_size=4, num_workers=2, persistent_workers=True)
    workers = set()
    for b in itertools.islice(iter(loader), 4):  # forks the workers while the file is open
        workers.update(b.tolist())
    assert len(workers) == 2 and os.getpid() not in workers
    for pid in workers:
        assert open_files(engine.directory, pid) == []
    loss.backward()
    assert files(engine) == []
    del loader


def test_engine_is_unusable_in_a_forked_child(engine: save_on_disk) -> None:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with engine:
                pass
        except RuntimeError as err:
            code = 0 if "forked child" in str(err) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


class Interrupting:
    """Stands in for the writer's queue: a KeyboardInterrupt before or after the real put."""

    def __init__(self, real, after: bool) -> None:  # noqa: ANN001
        self.real, self.after = real, after

    def put(self, item: object) -> None:
        if self.after:
            self.real.put(item)
        raise KeyboardInterrupt


@pytest.mark.parametrize("budget", [None, 2 * MiB])  # under a budget the hand-over comes from a later pack
@pytest.mark.parametrize("after", [False, True])
def test_interrupted_pack_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: bool,
                                               budget: int | None) -> None:
    engine = save_on_disk(threshold_bytes=64 << 10, directory=tmp_path, budget_bytes=budget)
    model, x = mlp(), batch()
    monkeypatch.setattr(engine._engine.writer, "jobs", Interrupting(engine._engine.writer.jobs, after))
    with pytest.raises(KeyboardInterrupt):
        with engine:
            model(x)
    monkeypatch.undo()
    assert not engine.active and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    gc.collect()
    engine.flush()
    s = engine.stats()
    assert s.bytes_pending_write == 0 and s.bytes_in_memory == 0 and files(engine) == []
    ref = train_step(model, x, None)
    assert all(torch.equal(a, b) for a, b in zip(ref, train_step(model, x, engine), strict=True))
    engine.close()


def test_no_engine_code_when_a_handle_dies(engine: save_on_disk) -> None:
    assert not hasattr(records.Handle, "__del__")
    model, x = mlp(), batch()
    with engine:
        loss = model(x).sum()
    engine.flush()
    calls: list[str] = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_filename) if event == "call" else None)
    try:
        del loss  # frees the graph and every handle in this thread
    finally:
        sys.setprofile(None)
    assert not [f for f in calls if "offload" in f]
    assert files(engine) == []  # the reader thread closed the file


def test_atexit_cleanup_in_subprocess(tmp_path: Path) -> None:
    proc = run_python(f"""
        import torch
        from lightning_gradhooks.offload import save_on_disk
        e = save_on_disk(threshold_bytes=1 << 16, directory={str(tmp_path)!r})
        with e:
            loss = torch.nn.Linear(256, 256)(torch.randn(512, 256)).exp().sum()
        e.flush()
        import os; print(e.stats().files_on_disk, len(os.listdir(e.directory)))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1 0" and proc.stderr == ""
    assert os.listdir(tmp_path) == []


def test_unusable_folder_fails_at_construction(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    with pytest.raises(DiskOffloadError, match=r"expected an existing folder, got .*afile.*Not a directory") as info:
        save_on_disk(threshold_bytes=MiB, directory=tmp_path / "afile")
    assert info.value.errno == errno.ENOTDIR
    with pytest.raises(DiskOffloadError, match=r"expected an existing folder, got .*missing.*No such file") as info:
        save_on_disk(threshold_bytes=MiB, directory=tmp_path / "missing")
    assert info.value.errno == errno.ENOENT and not (tmp_path / "missing").exists()  # not created


def test_read_only_folder_fails_at_construction(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as folder:
        with pytest.raises(DiskOffloadError, match=r"can hold an unnamed file.*Read-only file system") as info:
            save_on_disk(threshold_bytes=MiB, directory=folder)
        assert info.value.errno == errno.EROFS and str(folder) in str(info.value)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"threshold_bytes": -1}, "`threshold_bytes` expected a non-negative int, got -1"),
    ({"threshold_bytes": 1.5}, "`threshold_bytes` expected a non-negative int, got 1.5"),
    ({"threshold_bytes": True}, "`threshold_bytes` expected a non-negative int, got True"),
    ({"threshold_bytes": 1, "directory": 3}, "`directory` expected a str, os.PathLike or None, got 3"),
    ({"threshold_bytes": 1, "directory": ""}, "`directory` expected a non-empty path without NUL bytes, got ''"),
    ({"threshold_bytes": 1, "directory": "/tmp/a\0b"}, "without NUL bytes"),
    ({"threshold_bytes": 1, "max_bytes_in_flight": 0}, "`max_bytes_in_flight` expected a positive int, got 0"),
    ({"threshold_bytes": 1, "prefetch_bytes": -5}, "`prefetch_bytes` expected a non-negative int, got -5"),
    ({"threshold_bytes": 1, "segment_bytes": "1G"}, "`segment_bytes` expected a positive int, got '1G'"),
    ({"threshold_bytes": 1, "fix_mmap_threshold": 1}, r"`fix_mmap_threshold` expected a bool \(True or False\), got 1"),
])
def test_argument_checks(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        save_on_disk(**kwargs)


def test_write_failure_is_clear_and_leaves_nothing(engine: save_on_disk, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: memoryview, off: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer, "pwrite_all", full)
    model, x = mlp(depth=8), batch()
    with pytest.raises(DiskOffloadError) as info:
        with engine:
            model(x).sum().backward()
    err = info.value
    assert err.errno == errno.ENOSPC and engine.directory in str(err) and f"{MiB} bytes" in str(err)
    del info, err
    gc.collect()
    assert files(engine) == [] and engine.stats().bytes_in_memory == 0
    monkeypatch.undo()  # the disk has room again: the engine is still usable
    ref = train_step(model, x, None)
    assert all(torch.equal(a, b) for a, b in zip(ref, train_step(model, x, engine), strict=True))


def test_late_write_failure_surfaces_at_exit_or_backward(engine: save_on_disk,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()

    def late(fd: int, data: memoryview, off: int) -> None:
        gate.wait(10)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(writer, "pwrite_all", late)
    model, x = mlp(depth=1), batch()
    with engine:
        loss = model(x).sum()  # no error yet: the writes are still waiting
    gate.set()
    while engine.stats().bytes_pending_write:
        threading.Event().wait(0.01)
    with pytest.raises(DiskOffloadError, match="could not write"):
        loss.backward()  # at the latest at the first unpack
    del loss
    gc.collect()
    assert files(engine) == []
    monkeypatch.undo()  # the disk works again: the error was told once, the next step works
    ref = train_step(model, x, None)
    assert all(torch.equal(a, b) for a, b in zip(ref, train_step(model, x, engine), strict=True))


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    with mounted_tmpfs(tmp_path / "small", "size=20m") as mount:
        yield mount


def test_full_disk_gives_its_space_back_and_the_next_step_works(small_tmpfs: Path) -> None:
    e = save_on_disk(threshold_bytes=MiB, directory=small_tmpfs)
    free = free_bytes(small_tmpfs)
    big, x = mlp(depth=16), batch()  # 32 MiB of activations on a 20 MiB disk
    with pytest.raises(DiskOffloadError) as info:
        with e:
            loss = big(x).sum()
        loss.backward()
    err = info.value
    assert err.errno == errno.ENOSPC and str(small_tmpfs) in str(err) and f"{MiB} bytes" in str(err)
    del info, err
    gc.collect()
    s = e.stats()
    assert s.files_on_disk == 0 and s.bytes_in_memory == 0 and files(e) == []
    assert free_bytes(small_tmpfs) >= free - (64 << 10)  # all of it back
    small = mlp(depth=1)
    ref = train_step(small, x, None)
    assert all(torch.equal(a, b) for a, b in zip(ref, train_step(small, x, e), strict=True))
    e.close()


def test_read_error_in_backward_is_clear_and_frees_everything(engine: save_on_disk,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fd: int, data: memoryview, off: int, *a: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    model, x = mlp(), batch()
    with engine:
        loss = model(x).sum()
    engine.flush()
    monkeypatch.setattr(reader, "pread_all", broken)
    with pytest.raises(DiskOffloadError) as info:
        loss.backward()
    err = info.value
    assert err.errno == errno.EIO and engine.directory in str(err) and f"{MiB} bytes" in str(err)
    cause = err.__cause__  # the original error, without its traceback (whose frames hold the engine)
    assert isinstance(cause, OSError) and cause.errno == errno.EIO and cause.__traceback__ is None
    assert err.__context__ is None
    del info, err, loss
    gc.collect()
    s = engine.stats()
    assert s.files_on_disk == 0 and s.bytes_in_memory == 0 and files(engine) == []
    monkeypatch.undo()
    ref = train_step(model, x, None)
    assert all(torch.equal(a, b) for a, b in zip(ref, train_step(model, x, engine), strict=True))


def test_short_read_is_an_error_naming_folder_and_bytes(engine: save_on_disk,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.preadv

    def short(fd: int, buffers: list, offset: int) -> int:  # the file ends early: half, then nothing
        if offset % MiB:
            return 0
        return real(fd, [memoryview(buffers[0])[: len(buffers[0]) // 2]], offset)

    model, x = mlp(), batch()
    with engine:
        loss = model(x).sum()
    engine.flush()
    monkeypatch.setattr(os, "preadv", short)
    with pytest.raises(DiskOffloadError, match=rf"could not read {MiB} bytes from folder .*short read") as info:
        loss.backward()
    assert info.value.errno == errno.EIO and engine.directory in str(info.value)
    del info, loss
    gc.collect()
    assert files(engine) == [] and engine.stats().bytes_in_memory == 0


def test_file_size_limit_in_subprocess(tmp_path: Path) -> None:
    proc = run_python(f"""
        import errno, os, resource, signal, torch
        from lightning_gradhooks.offload import DiskOffloadError, save_on_disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))
        e = save_on_disk(threshold_bytes=1 << 20, directory={str(tmp_path)!r})
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
        try:
            with e:
                model(torch.randn(1024, 256)).sum().backward()
        except DiskOffloadError as err:
            print("errno", err.errno == errno.EFBIG, e.directory in str(err), "1048576 bytes" in str(err))
        import gc; gc.collect()
        print("left", os.listdir(e.directory), e.stats().files_on_disk)
        e.close()
    """)
    assert proc.returncode == 0, proc.stderr
    assert "errno True True True" in proc.stdout and "left [] 0" in proc.stdout
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------- prefetch, threads, imports


@pytest.mark.parametrize("segment_bytes", [1 << 30, 1])  # one file per step, or one per tensor
def test_prefetch_reads_in_reverse_order_on_reader_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         segment_bytes: int) -> None:
    engine = save_on_disk(threshold_bytes=64 << 10, directory=tmp_path, segment_bytes=segment_bytes)
    reads: list[tuple[int, int, str]] = []
    real = reader.pread_all

    def spy(fd: int, data: memoryview, off: int) -> None:
        index = next(s.index for s in list(engine._engine.segments.by_index.values()) if s.fd == fd)
        reads.append((index, off, threading.current_thread().name))
        real(fd, data, off)

    monkeypatch.setattr(reader, "pread_all", spy)
    model, x = mlp(depth=6), batch()
    with engine:
        loss = model(x).sum()
    engine.flush()
    assert engine.stats().files_on_disk == (1 if segment_bytes > 1 else 12)
    loss.backward()
    places = [(file, off) for file, off, _ in reads]
    assert len(reads) == 12 and places == sorted(places, reverse=True)  # newest first
    assert all(name == "save_on_disk-reader" for *_, name in reads)  # never the training thread
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_roundtrip_and_grads(engine: save_on_disk) -> None:
    model, x = mlp().cuda(), batch().cuda()
    ref = train_step(model, x, None)
    got = train_step(model, x, engine)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    for dtype in (torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
        v = torch.randn(300, 200, device="cuda").to(dtype).t()[3:]
        (back,) = roundtrip(engine, v)
        assert back.device == v.device and back.stride() == v.stride() and torch.equal(back, v)
    torch.cuda.synchronize()
    assert engine.stats().files_on_disk == 0


def test_engine_collected_without_close_stops_its_threads_and_closes_its_files(tmp_path: Path) -> None:
    e = save_on_disk(threshold_bytes=64 << 10, directory=tmp_path)
    with e:
        loss = mlp()(batch()).sum()
    e.flush()
    threads = e._engine.gate.threads
    assert len(open_files(tmp_path)) == 1 and all(t.is_alive() for t in threads)
    del e, loss
    gc.collect()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads) and open_files(tmp_path) == []
