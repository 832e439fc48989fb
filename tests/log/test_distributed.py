"""Pooling over ranks (distributed.py's ``RankReducer``) with two gloo processes: the pooled hook
statistics are those of the global batch, parameter gradients stay each rank's own, and a name
only one rank saw makes the ranks agree on a new layout without losing it. Sharded parameters:
tests/shell/test_sharded.py; through a Trainer: tests/shell/test_ddp.py."""

import json

import pytest
import torch
import torch.multiprocessing as mp

import rank_pooling


def hook_entries(entries: dict) -> dict:
    return {key: value for key, value in entries.items() if not key.startswith("param_grad")}


def test_two_ranks_pool_into_the_statistics_of_the_global_batch(tmp_path):
    """5 to 10 s on two cores: two fresh processes import torch; pooling needs two ranks."""
    mp.start_processes(rank_pooling.run, args=(tmp_path,), nprocs=2, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # The same model on both ranks' batches at once, in this process: what pooling must give.
    whole = rank_pooling.steps(rank_pooling.Net(), torch.cat([rank_pooling.batch(0), rank_pooling.batch(1)]),
                               False, None)
    for step in range(2):
        pooled = [rank["steps"][step]["pooled"] for rank in ranks]
        hooks = hook_entries(pooled[0])
        assert hook_entries(pooled[1]) == hooks  # the same on every rank
        reference = hook_entries(whole[step]["local"])
        assert hooks.keys() - {"grad_output extra", "output extra"} == reference.keys() and len(reference) >= 2
        for key, (stats, calls, count, histogram) in reference.items():
            got_stats, got_calls, got_count, got_histogram = hooks[key]
            assert (got_calls, got_count) == (2 * calls, count), key  # one call on each rank
            assert got_stats == pytest.approx(stats, rel=1e-5, abs=1e-9), key
            assert (got_histogram is None) == (histogram is None), key
            assert histogram is None or sum(got_histogram) == sum(histogram) == count, key
        for r in (0, 1):  # parameter gradients: each rank's own (a DDP all-reduce has averaged them)
            own = {k: v for k, v in ranks[r]["steps"][step]["local"].items() if k.startswith("param_grad")}
            assert own and {k: v for k, v in pooled[r].items() if k.startswith("param_grad")} == own
    # At the second step only rank 1 ran `extra`: the ranks agreed again and kept its entry.
    assert "grad_output extra" not in ranks[0]["steps"][1]["local"]
    assert ranks[0]["steps"][1]["pooled"]["grad_output extra"] == ranks[1]["steps"][1]["local"]["grad_output extra"]
    # Agree and gather at the first step; gather, agree, gather again at the second.
    assert ranks[0]["collectives"] == ranks[1]["collectives"] == 5
