"""``python -m lightning_gradhooks report LOGDIR``: the gradient-health report of a logged run.

Reads the TensorBoard event files under ``LOGDIR`` (each folder holding event files is one run)
with TensorBoard's own event reader, rebuilds every logged step from the GradHooks tags and
prints the report of :mod:`lightning_gradhooks.report`. Works while the run is still going.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from lightning_gradhooks.report import FLAGS, HealthReport, Thresholds

KINDS = ("grad_output", "grad_input", "param_grad", "param")


def _parse_tag(tag: str) -> tuple[str, str, str] | None:
    """``grad_output_norm/net.0`` -> ``("grad_output", "norm", "net.0")``; None for other tags."""
    section, _, name = tag.partition("/")
    for kind in KINDS:
        if section.startswith(kind + "_") and name:
            return kind, section[len(kind) + 1 :], name
    return None


def read_run(folder: Path, thresholds: Thresholds) -> HealthReport:
    """The report of the event files directly in ``folder``, steps in order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    steps: dict[int, dict[tuple[str, str], dict[str, float]]] = defaultdict(dict)
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                parsed = _parse_tag(value.tag)
                if parsed is None:
                    continue
                if value.HasField("simple_value"):
                    number = value.simple_value
                elif value.metadata.plugin_data.plugin_name == "scalars":  # as the loader migrates it
                    number = float(tensor_util.make_ndarray(value.tensor))
                else:
                    continue
                kind, stat, name = parsed
                steps[event.step].setdefault((kind, name), {})[stat] = number
    report = HealthReport(thresholds)
    for step in sorted(steps):
        report.add_stats(step, steps[step])
    return report


def _flag_list(text: str) -> set[str]:
    chosen = {f.strip() for f in text.split(",") if f.strip()}
    unknown = chosen - set(FLAGS)
    if unknown:
        raise argparse.ArgumentTypeError(f"expected flags from {', '.join(FLAGS)}, got {', '.join(sorted(unknown))}")
    return chosen


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_gradhooks", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser(
        "report",
        help="print the gradient-health report of the runs under LOGDIR",
        description="Print the gradient-health report (flags: " + ", ".join(FLAGS) + ") of every run under "
        "LOGDIR (a folder holding TensorBoard event files written by GradHooks, searched recursively). "
        "Exit status: 0, or 1 when a flag named in --fail-on is present, 2 for a usage error.",
    )
    report.add_argument("logdir", metavar="LOGDIR", type=Path, help="a run folder or a folder of runs")
    report.add_argument(
        "--fail-on",
        type=_flag_list,
        default=set(),
        metavar="FLAGS",
        help="comma-separated flags that make the command exit with status 1, e.g. nonfinite,exploding "
        "(default: none, always exit 0)",
    )
    for f in fields(Thresholds):
        report.add_argument(
            f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
            help=f"threshold (default: {f.default}); see lightning_gradhooks.report.Thresholds",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.logdir.is_dir():
        _parser().error(f"LOGDIR expected an existing folder, got {str(args.logdir)!r}")
    thresholds = Thresholds(**{f.name: getattr(args, f.name) for f in fields(Thresholds)})
    runs = sorted({p.parent for p in args.logdir.rglob("events.out.tfevents.*")})
    if not runs:
        print(f"no TensorBoard event files under {args.logdir}", file=sys.stderr)
        return 1 if args.fail_on else 0
    failed = set()
    for run in runs:
        report = read_run(run, thresholds)
        print(f"== {run}\n{report.table()}")
        failed |= report.names(args.fail_on)
    if failed:
        print(f"failing on: {', '.join(sorted(failed))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
