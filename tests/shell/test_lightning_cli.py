"""GradHooks is configurable from LightningCLI: YAML and command line, plain typed arguments."""

import pytest
from pytorch_lightning.cli import LightningCLI

from lightning_gradhooks import GradHooks

from conftest import MLP

pytest.importorskip("jsonargparse")


def callbacks_of(cli: LightningCLI) -> list[GradHooks]:
    return [c for c in cli.trainer.callbacks if isinstance(c, GradHooks)]


def test_configured_from_yaml(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_gradhooks.GradHooks\n"
        "      init_args:\n"
        "        every_n_steps: 7\n"
        "        include: ['net.*']\n"
        "        statistics: [norm, nonfinite]\n"
        "        histograms: false\n"
        "        offload_threshold_bytes: 1048576\n"
    )
    cli = LightningCLI(MLP, run=False, args=["--config", str(config), f"--trainer.default_root_dir={tmp_path}"])
    (callback,) = callbacks_of(cli)
    assert (callback.every_n_steps, callback.include, callback.statistics) == (7, ["net.*"], ["norm", "nonfinite"])
    assert callback.histograms is False and callback.offload_threshold_bytes == 1 << 20


def test_configured_from_command_line(tmp_path):
    cli = LightningCLI(
        MLP, run=False,
        args=["--trainer.callbacks+=lightning_gradhooks.GradHooks", "--trainer.callbacks.every_n_steps=3",
              "--trainer.callbacks.exclude=[net.0]", f"--trainer.default_root_dir={tmp_path}"],
    )
    (callback,) = callbacks_of(cli)
    assert callback.every_n_steps == 3 and callback.exclude == ["net.0"]


def test_bad_value_from_the_command_line_is_refused(tmp_path):
    with pytest.raises(SystemExit):  # jsonargparse checks the Literal type hint
        LightningCLI(
            MLP, run=False,
            args=["--trainer.callbacks+=lightning_gradhooks.GradHooks", "--trainer.callbacks.statistics=[median]",
                  f"--trainer.default_root_dir={tmp_path}"],
        )
