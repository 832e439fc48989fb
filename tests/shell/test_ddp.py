"""DDP on CPU (gloo, two processes): rank 0 writes, local or pooled statistics, offload cleaned.

``strategy="ddp"`` starts rank 1 by running the script again, so the cases run
``tests/helpers/ddp_train.py`` in a fresh process tree: all three fits in one, one after the other.
"""

import json
from pathlib import Path

import pytest
import torch

from lightning_gradhooks.core.stats import reduce

from conftest import pooled_calls, read_events, tag
from launch import run_script
from report_panel import cli_table


MODES = ("local", "sync", "nan")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The fits of every mode, one after the other in one pair of rank processes (a pair costs
    seconds to start): ``runs / mode`` holds each one's output."""
    out = tmp_path_factory.mktemp("ddp")
    run_script(out, "ddp_train.py", ",".join(MODES))
    return out


@pytest.mark.parametrize("mode", ["local", "sync"])
def test_ddp_on_two_cpu_processes(runs, mode):
    tmp_path = runs / mode
    # Only rank 0 wrote events: the logger's file and GradHooks' own, in one folder.
    files = [p for p in (tmp_path / "logs").rglob("events.out.tfevents.*")]
    assert len(files) == 2 and len({p.parent for p in files}) == 1
    assert len([p for p in files if p.name.endswith(".gradhooks")]) == 1
    events = read_events(str(files[0].parent))
    grads = [torch.load(tmp_path / f"grads-rank{r}.pt") for r in (0, 1)]
    steps = len(grads[0])
    assert [e.step for e in events.Scalars("∇2 grad_output_norm/net.2")] == list(range(steps)) == [0, 1, 2]
    for step in range(steps):
        if mode == "local":
            want = reduce([grads[0][step]])[0][0]  # rank 0's own shard
        else:  # pooled over both ranks: the statistics of the global batch
            want = reduce([torch.cat([grads[0][step], grads[1][step]])])[0][0]
        assert not torch.equal(grads[0][step], grads[1][step])  # the shards differ
        for i, stat in enumerate(("norm", "mean", "std", "absmax")):
            got = events.Scalars(tag("grad_output", stat, "net.2"))[step].value
            assert got == pytest.approx(want[i], rel=1e-5, abs=1e-8), (stat, step)
    assert list(pooled_calls(str(files[0].parent), "net.2").values()) == [2 if mode == "sync" else 1] * steps
    facts = [json.loads((tmp_path / f"facts-rank{r}.json").read_text()) for r in (0, 1)]
    # Both ranks offloaded into the same folder with files that never had a name: none is left.
    assert facts[0]["offload_dir"] == facts[1]["offload_dir"] == str(tmp_path / "offload")
    assert facts[0]["offload_written"] > 0 and facts[1]["offload_written"] > 0
    assert not any((tmp_path / "offload").iterdir())
    if mode == "sync":
        # One gather per logged step, plus agreeing on the names: at the first step, and again at
        # the second, where grad_input appears (the first step after attach logs grad_output only).
        assert facts[0]["collectives"] == steps + 3
    else:
        assert facts[0]["collectives"] == 0


def test_a_nan_from_another_rank_is_named_with_its_rank(runs):
    """Rank 1's batch holds a NaN at step 1; rank 0's forward, loss and own gradients are finite,
    and the all-reduce brings the NaN. The report says so, and names rank 1 (the noise probe reads
    each rank's gradient before the all-reduce); the command says the same."""
    tmp_path = runs / "nan"
    report = (tmp_path / "report.txt").read_text()
    first = report.splitlines()[2].split()
    assert first[:3] == ["nonfinite", "net.0", "1"], report
    assert ("another rank: the gradients of rank 1 were already non-finite before the all-reduce, which brought "
            "them here (this rank's forward, loss and own gradients were finite); first seen in param_grad of") in report
    assert "born in backward" not in report
    assert cli_table(str(next((tmp_path / "logs").glob("version_*")))) == report
