"""planning.py: which modules are chosen (``select_modules``) and each one's read plan (``Planner``)."""

import collections

import pytest
import torch
from torch import nn

from lightning_gradhooks.core.compiled import COMPILED
from lightning_gradhooks.core.planning import Planner, Read, select_modules


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Dropout(0.0), nn.Linear(8, 2))


# -- select_modules -------------------------------------------------------------------------------
def test_without_include_the_modules_that_own_a_trainable_parameter_are_chosen():
    model = net()
    model[2].requires_grad_(False)
    assert list(select_modules(model)) == ["0", "4"]


def test_include_and_exclude_are_whole_name_globs():
    model = nn.Sequential(collections.OrderedDict(encoder=net(), head=nn.Linear(2, 1)))
    assert list(select_modules(model, include=["encoder.*"], exclude=["encoder.1", "encoder.3"])) == [
        "encoder.0", "encoder.2", "encoder.4"]
    assert list(select_modules(model, include=["head", ""])) == ["", "head"]  # the root's name is ""


def test_an_include_that_matches_nothing_says_which_names_exist_and_what_was_meant():
    class Lit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(collections.OrderedDict(encoder=net()))

    with pytest.raises(ValueError, match=r"`include` pattern 'encoder\.\*' matches no module of Lit; module names "
                                         r"look like: '', 'model', .*; did you mean \"model\.encoder\.\*\"\?$"):
        select_modules(Lit(), include=["encoder.*"])


def test_an_exclude_that_matches_nothing_is_warned_about_and_excludes_nothing():
    with pytest.warns(UserWarning, match=r"`exclude` pattern '\*\.dropout' matches no module .* It excludes nothing"):
        chosen = select_modules(net(), exclude=["*.dropout"])
    assert list(chosen) == ["0", "2", "4"]


def test_an_empty_selection_and_bad_patterns_are_refused():
    assert list(select_modules(net(), include=["1"])) == ["1"]  # include picks modules without parameters too
    with pytest.raises(ValueError, match=r"no module of Sequential was selected"):
        select_modules(net(), exclude=["*"])
    with pytest.raises(ValueError, match=r"`include` expected"):
        select_modules(net(), include="0")


def test_names_are_those_before_torch_compile():
    model = nn.Sequential(collections.OrderedDict(body=net()))
    model.body = torch.compile(model.body, backend="eager")  # wraps it: body._orig_mod.0
    assert list(select_modules(model)) == ["body.0", "body.2", "body.4"]


# -- Planner --------------------------------------------------------------------------------------
def probe(modules: dict[str, nn.Module], run) -> tuple[Planner, list[str]]:  # noqa: ANN001
    """A planner of ``modules`` whose probe sees the forward ``run()`` (hooks as the monitor puts them)."""
    planner = Planner(modules, hidden={})
    planner.start()
    assert planner.probing
    handles = []
    for label, module in modules.items():
        handles.append(module.register_forward_pre_hook(lambda m, args, label=label: planner.probe_inputs(label, args)))
        handles.append(module.register_forward_hook(
            lambda m, args, out, label=label: planner.probe_outputs(label, args, out) and None))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    in_place = planner.finish()
    assert not planner.probing
    return planner, in_place


def test_every_module_is_probed_first_and_hidden_ones_get_parameters_only_with_their_reason():
    model = net()
    planner = Planner({"0": model[0], "2": model[2]}, hidden={id(model[2]): COMPILED})
    assert planner.plans["0"].read is Read.PROBE and planner.plans["2"].read is Read.PARAMETERS_ONLY
    assert planner.plans["2"].reason == COMPILED
    assert list(planner.hooked) == ["0"]


def test_one_op_layers_are_read_from_their_edge_other_modules_through_views_and_in_place_use_or_structure_or_absence_means_output_only():
    class Pair(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN201
            return {"a": x * 2, "b": x * 3}

    class AddsInPlace(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN201
            return x.add_(1)

    class Square(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN201
            return x * x

    model, pair, adds, unused, square, seq = net(), Pair(), AddsInPlace(), nn.Linear(8, 8), Square(), nn.Linear(8, 8)
    modules = {"plain": model[0], "relu_victim": model[2], "pair": pair, "adds": adds, "unused": unused,
               "square": square, "seq": seq}

    def run() -> None:
        h = model[0](torch.randn(3, 4, requires_grad=True))
        out = model[2](torch.relu(h))
        out.relu_()  # modifies the Linear's output after it returned
        pair(out)
        adds(out * 1)
        square(out * 1)
        seq(out[:, None] * 1)  # a Linear on 3-D input: a view, addmm, a view

    planner, in_place = probe(modules, run)
    reads = {label: plan.read for label, plan in planner.plans.items()}
    assert reads == {"plain": Read.EDGE, "relu_victim": Read.OUTPUT_ONLY, "pair": Read.OUTPUT_ONLY,
                     "adds": Read.OUTPUT_ONLY, "unused": Read.OUTPUT_ONLY, "square": Read.VIEWS, "seq": Read.VIEWS}
    assert in_place == ["adds", "relu_victim"]
    assert "modified in place" in planner.plans["adds"].reason
    assert "not a tensor or a flat tuple" in planner.plans["pair"].reason
    assert "did not run" in planner.plans["unused"].reason
    assert "one op" in planner.plans["plain"].reason and "not one op" in planner.plans["seq"].reason
    assert "one op" not in planner.plans["square"].reason  # not a layer of torch.nn known to be one op


def test_a_probe_without_its_backward_is_dropped_and_runs_again():
    model = net()
    planner = Planner({"0": model[0]}, hidden={})
    planner.start()
    planner.stop()
    assert not planner.probing and not planner.probe_outputs("0", (), torch.ones(1))  # no probe: nothing seen
    assert planner.plans["0"].read is Read.PROBE
    planner, _ = probe({"0": model[0]}, lambda: model[0](torch.randn(2, 4)))
    assert planner.plans["0"].read is Read.EDGE
    planner.start()  # every plan is lasting: no probe starts again
    assert not planner.probing
