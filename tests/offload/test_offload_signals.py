"""Offload under every way a run can end: SIGKILL, a forked DDP worker's ``os._exit``, Ctrl-C at
random moments. Each case runs tests/helpers/offload_victim.py in a subprocess. Free space is measured
on a private tmpfs where one can be mounted (root), else those checks are skipped."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bfree * st.f_frsize


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, options: str) -> Iterator[Path]:
    """A tmpfs of its own at ``mount`` (nobody else changes its free space), or skip the test."""
    mount.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs", "size=64m,mode=0700") as mount:
        yield mount


class Victim:
    """tests/helpers/offload_victim.py in its own session, its output lines readable with a timeout."""

    def __init__(self, mode: str, folder: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_RANK", "RANK", "WORLD_SIZE",
                                                                          "MASTER_"))}
        env["PYTHONPATH"] = str(REPO)
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "helpers" / "offload_victim.py"), mode, str(folder)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()

    @staticmethod
    def _pump(stream, sink) -> None:  # noqa: ANN001
        for line in stream:
            sink(line)

    def expect(self, prefix: str, timeout: float = 60) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                self.kill()
                pytest.fail(f"no {prefix!r} within {timeout} s (hung or lost); stderr:\n{''.join(self.stderr)[-3000:]}")
            if line.startswith(prefix):
                return line.split()[1:]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # DDP workers are in its session too
        except ProcessLookupError:
            pass
        self.proc.wait(30)


def test_sigkill_mid_step_leaves_the_folder_as_it_was(tmpfs: Path) -> None:
    (tmpfs / "keep.txt").write_text("the user's file")
    before, free = sorted(os.listdir(tmpfs)), free_bytes(tmpfs)
    victim = Victim("kill", tmpfs)
    try:
        (on_disk,) = map(int, victim.expect("READY"))
        # Mid-step: nothing visible, but the space is in use.
        assert sorted(os.listdir(tmpfs)) == before
        used = free - free_bytes(tmpfs)
        assert on_disk >= 8 * MiB and 0.9 * on_disk <= used <= on_disk + 2 * MiB
    finally:
        victim.kill()
    assert victim.proc.returncode == -signal.SIGKILL
    assert sorted(os.listdir(tmpfs)) == before
    assert free_bytes(tmpfs) >= free - (64 << 10)  # the kernel gave the space back


def test_ddp_fork_worker_leaving_through_os_exit_leaves_nothing(tmpfs: Path) -> None:
    free = free_bytes(tmpfs)
    victim = Victim("ddp_fork", tmpfs)
    try:
        victim.expect("READY", timeout=60)
        victim.proc.wait(60)
    finally:
        victim.kill()
    assert victim.proc.returncode != 0  # the launcher saw its worker die
    assert os.listdir(tmpfs) == []
    assert free_bytes(tmpfs) >= free - (64 << 10)


def test_forty_sigints_at_random_moments_none_lost(tmp_path: Path) -> None:
    victim = Victim("sigint", tmp_path)
    rng = random.Random(0)
    try:
        victim.expect("START")
        for n in range(1, 41):
            threading.Event().wait(rng.uniform(0.002, 0.04))
            os.kill(victim.proc.pid, signal.SIGINT)
            assert victim.expect("CAUGHT", timeout=20) == [str(n)]  # a lost one would time out here
        files_open, pending = map(int, victim.expect("DONE", timeout=20))
        assert victim.proc.wait(30) == 0
    finally:
        victim.kill()
    stderr = "".join(victim.stderr)
    assert "Exception ignored" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert files_open == 0 and pending == 0
    assert os.listdir(tmp_path) == []


def test_ctrl_c_ends_lightning_fit_gracefully(tmp_path: Path) -> None:
    rng = random.Random(1)
    folders = [tmp_path / str(i) for i in range(3)]
    victims = []
    for folder in folders:
        folder.mkdir()
        victims.append(Victim("lightning_sigint", folder))
    try:
        for victim in victims:
            victim.expect("READY")
            threading.Event().wait(rng.uniform(0.0, 0.3))  # somewhere in a later step
            os.kill(victim.proc.pid, signal.SIGINT)
        for victim in victims:
            assert victim.proc.wait(60) == 1  # Lightning's graceful shutdown exits with 1
    finally:
        for victim in victims:
            victim.kill()
    for victim, folder in zip(victims, folders):
        stderr = "".join(victim.stderr)
        assert "Detected KeyboardInterrupt" in stderr and "Exception ignored" not in stderr, stderr[-3000:]
        assert os.listdir(folder) == []
