"""Sharded training on CPU (gloo, two processes): FSDP2 and tensor parallelism through a real
Trainer with Lightning's ``ModelParallelStrategy``; FSDP1 views, HSDP on a 2-D mesh and a
Partial gradient with plain ``torch.distributed`` (``tests/helpers/sharded_ranks.py``).

The logged ``param_grad_*`` statistics must be those of the same model trained unsharded, in
this process, on the same global batch.
"""

import json

import pytest
import torch
from torch import nn

from lightning_gradhooks.core.stats import reduce

from conftest import pooled_calls, read_events, tag
from launch import run_script
from report_panel import cli

STATS = ("norm", "mean", "std", "absmax")


def close(got: list[float], row: list[float]) -> bool:
    """rtol 1e-5; a mean that cancels to ~0 (a softmax bias) is compared to the norm's rounding."""
    return got == pytest.approx(row[:4], rel=1e-5, abs=1e-6 * row[0] / 8 + 1e-12)


def unsharded(batches: list[list[torch.Tensor]]) -> tuple[list[dict], list[torch.Tensor]]:
    """Parameter gradients (by name) and net.0 output gradients of the unsharded model."""
    from sharded_train import build

    net = build()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    grads, outputs = [], []
    for x, y in batches:
        out0 = net[0](x)
        out0.register_hook(lambda g: outputs.append(g))
        nn.functional.cross_entropy(net[2](net[1](out0)), y).backward()
        grads.append({f"net.{n}": p.grad.clone() for n, p in net.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return grads, outputs


def check_parameters(events, grads: list[dict]) -> None:
    for name in grads[0]:
        for step, step_grads in enumerate(grads):
            (row, counts), = reduce([step_grads[name]], bins=64)
            got = [events.Scalars(tag("param_grad", stat, name))[step].value for stat in STATS]
            assert close(got, row), (name, step, got, row)
            histogram = events.Histograms(f"∇6 histograms/param_grad/{name}")[step].histogram_value
            assert histogram.num == step_grads[name].numel()  # the total count is exact
            assert sum(histogram.bucket) == step_grads[name].numel()


def load(tmp_path, ranks=(0, 1)) -> tuple[object, list[dict], list[dict]]:
    files = list((tmp_path / "logs").rglob("events.out.tfevents.*"))
    assert len(files) == 2 and len({p.parent for p in files}) == 1  # only rank 0 writes: the logger's and ours
    seen = [torch.load(tmp_path / f"seen-rank{r}.pt") for r in ranks]
    facts = [json.loads((tmp_path / f"facts-rank{r}.json").read_text()) for r in ranks]
    return read_events(str(files[0].parent)), seen, facts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The Lightning fits of every mode, one after the other in one pair of rank processes (a pair
    costs seconds to start): ``runs / mode`` holds each one's output."""
    out = tmp_path_factory.mktemp("sharded")
    run_script(out, "sharded_train.py", "fsdp2,tp,fp16")
    return out


def test_fsdp2_data_parallel(runs):
    tmp_path = runs / "fsdp2"
    events, seen, facts = load(tmp_path)
    # The global batch of each step: both ranks' batches.
    batches = [[torch.cat(pair) for pair in zip(a, b)] for a, b in zip(seen[0]["batches"], seen[1]["batches"])]
    grads, _ = unsharded(batches)
    check_parameters(events, grads)
    # Module hooks as under DDP with sync_dist: both ranks' batches pooled.
    log_dir = str(next((tmp_path / "logs").rglob("events.out.tfevents.*")).parent)
    assert list(pooled_calls(log_dir, "net.2").values()) == [2, 2, 2]
    for f in facts:
        # GradHooks' logging makes one gather per step, after agreeing on the hook names at the
        # first step; at the second, grad_input appears (the first logged step after attach logs
        # grad_output only): agree on names, gather again. And the noise probe's one all_reduce.
        assert f["collectives"] == [3, 4, 2]
        assert f["gathers"] == 6
        assert not f["hooks_left"]
        # Plain FSDP2 with save_on_disk: training bitwise equal; nothing written while only
        # the (16 KiB) unsharded weights were over the threshold, activations written after.
        assert f["offload_equal"]
        assert f["offload_written"][0] == 0 and f["offload_written"][-1] > 0
    assert not any((tmp_path / "offload").iterdir())


def test_tensor_parallel(runs):
    tmp_path = runs / "tp"
    events, seen, facts = load(tmp_path)
    grads, outputs = unsharded(seen[0]["batches"])  # both ranks see the same batch
    assert all(torch.equal(a, b) for a, b in zip(seen[0]["batches"][0], seen[1]["batches"][0]))
    check_parameters(events, grads)
    # Without sync_dist, rank 0 logs its own piece of net.0's output gradient (Colwise: half).
    for step, full in enumerate(outputs):
        assert seen[0]["grads"][step].shape == (8, 8)
        want = reduce([seen[0]["grads"][step]])[0][0]
        assert events.Scalars("∇2 grad_output_norm/net.0")[step].value == pytest.approx(want[0], rel=1e-5)
        assert torch.allclose(torch.cat([seen[0]["grads"][step], seen[1]["grads"][step]], 1), full, atol=1e-7)
    for f in facts:
        # the one gather of the sharded parameters, from the first step, and the noise probe's all_reduce
        assert f["collectives"] == [2, 2, 2]
        assert f["gathers"] == 3
        assert not f["hooks_left"]


def test_fsdp1_views_hsdp_on_a_2d_mesh_and_partial_placements(tmp_path):
    run_script(tmp_path, "sharded_ranks.py")
    facts = [json.loads((tmp_path / f"ranks-{r}.json").read_text()) for r in (0, 1)]
    # The flat-parameter views: rank 0 holds all of one parameter and nothing of the others.
    assert [f["fsdp1"]["local"] for f in facts] == [
        {"0.weight": 98, "0.bias": 0, "2.weight": 0, "2.bias": 0},
        {"0.weight": 30, "0.bias": 16, "2.weight": 48, "2.bias": 3},
    ]
    assert facts[0]["fsdp1"]["sharded"] == ["0.weight", "0.bias", "2.weight", "2.bias"]  # no wrapper prefix
    batches = [
        [torch.tensor(a[0] + b[0]), torch.tensor(a[1] + b[1])]
        for a, b in zip(facts[0]["fsdp1"]["batches"], facts[1]["fsdp1"]["batches"])
    ]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches):
        nn.functional.cross_entropy(net(x), y).backward()
        for f in facts:  # the same pooled entries on both ranks
            for name, p in net.named_parameters():
                stats, total = f["fsdp1"]["steps"][step][name]
                (row, _), = reduce([p.grad])
                assert close([stats[s] for s in STATS], row), (step, name)
                assert total == p.numel()
        optimizer.step()
        optimizer.zero_grad()
    assert facts[0]["fsdp1"]["gathers"] == 2  # one per step
    # HSDP on a 2-D mesh: replicated across dim 0, so only the rank at coordinate 0 reduces.
    assert facts[0]["hsdp"]["placements"] == "(Replicate(), Shard(dim=0))"
    assert [f["hsdp"]["local"] for f in facts] == [["0.weight", "0.bias", "2.weight", "2.bias"], []]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = (torch.tensor(facts[0]["hsdp"]["batch"][i] + facts[1]["hsdp"]["batch"][i]) for i in (0, 1))
    nn.functional.cross_entropy(net(x), y).backward()  # the replicas average their gradients
    for name, p in net.named_parameters():
        (row, _), = reduce([p.grad])
        for f in facts:
            stats, total = f["hsdp"]["pooled"][name]
            assert close([stats[s] for s in STATS], row), name
            assert total == p.numel()
    for f in facts:  # refused, with the reason
        assert f["partial"]["entries"] == ["bias"]
        assert "Partial" in f["partial"]["skipped"]["weight"]


def test_a_chosen_parameter_without_gradient_is_named_once(tmp_path):
    from lightning_gradhooks import GradHooks

    from conftest import MLP, loader, make_trainer

    class Unused(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.spare = nn.Linear(3, 3)  # chosen (it owns trainable parameters), never called

    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=1)], max_steps=3)
    with pytest.warns(UserWarning, match="give no param_grad entry") as caught:
        trainer.fit(Unused(), loader())
    told = [str(w.message) for w in caught if "param_grad entry" in str(w.message)]
    assert len(told) == 1 and "spare.weight, spare.bias (no gradient" in told[0]


def test_fsdp2_sharded_scaler_skips_are_a_note(runs):
    """FSDP2's ShardedGradScaler starting at 2^24 skips the first steps: one note, no flag, and
    the report command says the same (tests/helpers/sharded_fp16.py)."""
    tmp_path = runs / "fp16"
    text = (tmp_path / "report.txt").read_text()
    clean, note = text.splitlines()
    assert clean == "GradHooks: no gradient problems seen in 12 logged steps."
    assert note.startswith("note: the gradient scaler skipped 7 of 12 logged steps") and "from 2^24 to 2^17" in note
    code, out, _ = cli("report", (tmp_path / "log_dir.txt").read_text(), "--fail-on", "nonfinite")
    assert code == 0 and out.rstrip().endswith(text)
