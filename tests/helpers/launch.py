"""Run a helper script of this folder in a fresh process tree, as DDP and sharded tests need."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parent
LAUNCH_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
                    "MASTER_ADDR", "MASTER_PORT")


def run_script(out: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``tests/helpers/<script> OUT *args`` (a Lightning job that starts its other ranks itself).

    The child sees this process's ``sys.path``: the package under test, ``tests/`` (conftest),
    this folder and the folder of the test that calls.
    """
    # A leaked launcher variable makes Lightning wait for ranks that never come.
    env = {
        k: v for k, v in os.environ.items()
        if k not in LAUNCH_VARIABLES and not k.startswith(("PL_", "TORCHELASTIC_", "SLURM_"))
    }
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    process = subprocess.Popen(
        [sys.executable, str(HELPERS / script), str(out), *args],
        cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # rank 1 is a grandchild
        output, _ = process.communicate()
        pytest.fail(f"{script} timed out:\n{output[-3000:]}")
    assert process.returncode == 0, output[-4000:]
    return process
