"""``python -m lightning_gradhooks report LOGDIR``: the gradient-health report of a logged run.

Reads the TensorBoard event files under ``LOGDIR`` (each folder holding event files is one run),
checking every record's length and CRC-32C as TensorBoard writes them, rebuilds every logged
step from the compact summary GradHooks writes at each (``gradhooks/stats``: packed numbers in an
event of its own, or the JSON of earlier versions; the scalar charts in logs written before it)
and prints the report of :mod:`lightning_gradhooks.health`. Works
while the run is still going. A file that is cut short or damaged is read up to the damage, and
a warning names it and says what was read.

Exit status: 0 (no flag named in ``--fail-on``), 1 (a flag named in ``--fail-on`` was found),
2 (a usage error, or no GradHooks data under ``LOGDIR``).
"""

from __future__ import annotations

import argparse
import struct
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from lightning_gradhooks.log._tensorboard import OVERVIEW, STATS_TAG, SummaryReader, masked_crc32c
from lightning_gradhooks.core._text import counted
from lightning_gradhooks.core.noise import sentence_of
from lightning_gradhooks.core.records import Key, Kind, Summary
from lightning_gradhooks.health import FLAGS, HealthReport, Thresholds
from lightning_gradhooks.health.step import Packed, merge_summary

# Longest first: "forward_input_nonfinite" is not kind "forward" with statistic "input_nonfinite".
_KINDS_LONGEST_FIRST = sorted(Kind, key=len, reverse=True)


def _parse_tag(tag: str) -> tuple[Kind, str, str] | None:
    """``grad_output_norm/net.0`` -> ``(Kind.GRAD_OUTPUT, "norm", "net.0")``; None for other tags.

    The scalar tags of logs written before the compact summary and the numbered sections
    (today's charts start with ``∇`` and are not read: the summary holds all they hold)."""
    section, _, name = tag.partition("/")
    for kind in _KINDS_LONGEST_FIRST:
        if section.startswith(kind + "_") and name:
            return kind, section[len(kind) + 1 :], name
    return None


@dataclass
class _Damage:
    """Where an event file stops being readable, and what was read before."""

    path: Path
    offset: int
    reason: str
    events: int = 0
    steps: int = 0  # logged steps with GradHooks data among the events read


def read_records(path: Path) -> Iterator[bytes | _Damage]:
    """The records of a TFRecord file (an event file), each checked against its CRC-32C; a
    :class:`_Damage` last where the file is cut short or damaged."""
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        if len(data) - offset < 12:
            yield _Damage(path, offset, f"cut short: {counted(len(data) - offset, 'byte')} of a record header")
            return
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[offset + 8 : offset + 12])
        if masked_crc32c(header) != crc:
            yield _Damage(path, offset, "damaged record header (CRC mismatch)")
            return
        end = offset + 12 + length + 4
        if end > len(data):
            yield _Damage(path, offset, f"cut short: a record of {counted(length, 'byte')}, {len(data) - offset - 12} left")
            return
        payload = data[offset + 12 : offset + 12 + length]
        if masked_crc32c(payload) != struct.unpack("<I", data[end - 4 : end])[0]:
            yield _Damage(path, offset, "damaged record (CRC mismatch)")
            return
        yield payload
        offset = end


@dataclass
class Run:
    """What the event files of one run folder hold: the GradHooks statistics of each logged step
    as written (its summaries, laid end to end: the update ratios come in one of their own,
    after the gradients), in the order they were written, and the damage met while reading."""

    folder: Path
    parts: dict[int, list[Packed]]
    gradhooks: bool
    damage: list[_Damage]

    @property
    def steps(self) -> dict[int, Summary]:
        """The statistics by step, each step's summaries merged."""
        steps: dict[int, Summary] = {}
        for step, parts in self.parts.items():
            steps[step] = {}
            for part in parts:
                merge_summary(steps[step], part.summary().items())
        return steps

    def of(self, key: Key) -> dict[int, Summary]:
        """The statistics of one key, by step (the steps that hold it)."""
        found: dict[int, Summary] = {}
        for step, parts in self.parts.items():
            for part in parts:
                at = _positions(part.keys).get(key)
                if at is not None:
                    begin = sum(part.lengths[:at])
                    found.setdefault(step, {}).setdefault(key, {}).update(
                        zip(part.names[begin : begin + part.lengths[at]], part.values[begin : begin + part.lengths[at]].tolist()))
        return found


def _positions(keys: list[Key], _known: dict[int, tuple[list[Key], dict[Key, int]]] = {}) -> dict[Key, int]:  # noqa: B006
    """Each of ``keys``' position (remembered for the list, which a layout's summaries share)."""
    known = _known.get(id(keys))
    if known is None or known[0] is not keys:
        if len(_known) >= 64:
            _known.clear()
        known = _known[id(keys)] = (keys, {key: i for i, key in enumerate(keys)})
    return known[1]


#: Where a packed summary's tag lies in its event: after the wall time, the step and the lengths.
_STATS_BYTES, _STATS_WITHIN = STATS_TAG.encode(), 48


def read_folder(folder: Path) -> Run:
    """Read the event files directly in ``folder``, in name (= creation) order.

    Once a file is seen to hold packed summaries (each an event of its own), its other events
    (charts, histograms) are skipped without being parsed: the summaries hold all the report
    reads, and are kept as they are, numbers in an array (:class:`~lightning_gradhooks.health.step.Packed`).

    A run resumed from a checkpoint writes a new file into the same folder; where it logs a step
    that an earlier file holds already (a checkpoint older than the last logged step), the
    earlier file's steps from there on are dropped, as TensorBoard drops them: what the resumed
    run logged replaces them, and the report is the resumed run's own."""
    run, older = Run(folder, defaultdict(list), False, []), defaultdict(dict)
    for path in sorted(folder.glob("events.out.tfevents.*")):
        _read_file(path, run, older)
    for step, summary in older.items():
        run.parts[step].append(Packed.of(summary, round_to_float32=False))
    run.parts = dict(run.parts)
    return run


def _read_file(path: Path, run: Run, older: dict[int, Summary]) -> None:
    """Add the GradHooks data of one event file to ``run`` (that of logs written before the packed
    summary to ``older``: JSON summaries and scalar charts, merged by step)."""
    from tensorboard.compat.proto.event_pb2 import Event

    parts, events, logged, reader = run.parts, 0, set(), SummaryReader()
    plans: dict[int, tuple[list[Key], list[int], list[str]]] = {}  # each layout's keys, lengths and names
    restart: int | None = None  # the first step of this file with a summary
    for record in read_records(path):
        if isinstance(record, _Damage):
            record.events, record.steps = events, len(logged)
            run.damage.append(record)
            return
        events += 1
        if reader.packed and _STATS_BYTES not in record[:_STATS_WITHIN]:
            continue  # charts: not what the report reads
        try:
            event = Event.FromString(record)
        except Exception as error:  # a record whose CRC holds but whose bytes are no Event
            run.damage.append(_Damage(path, -1, f"a record is no event ({type(error).__name__})", events - 1, len(logged)))
            return
        for value in event.summary.value:
            run.gradhooks = run.gradhooks or value.tag.startswith((OVERVIEW + "/", "0_overview/"))  # today's, an older log's
            summary = reader.read_packed(value)
            if summary is not None:  # every statistic of the step, compact
                if restart is None:
                    restart = event.step
                    for steps in (parts, older):
                        for stale in [s for s in steps if s >= restart]:
                            del steps[stale]
                # A step's update ratios come in a summary of their own, later.
                if isinstance(summary, dict):
                    merge_summary(older[event.step], summary.items())
                else:
                    plan, numbers = summary
                    laid = plans.get(id(plan))
                    if laid is None:
                        laid = plans[id(plan)] = ([key for key, _ in plan], [len(names) for _, names in plan],
                                                  [name for _, names in plan for name in names])
                    parts[event.step].append(Packed(*laid, np.frombuffer(numbers, dtype=np.float64)))
            elif not _read_scalar(value, older, event.step):  # a scalar chart of an older log
                continue
            run.gradhooks = True
            logged.add(event.step)


def _read_scalar(value: Any, steps: dict[int, Summary], step: int) -> bool:
    """Add a scalar chart of a log written before the compact summary to ``steps[step]``; False
    for other values."""
    from tensorboard.util import tensor_util

    parsed = _parse_tag(value.tag)
    if parsed is None:
        return False
    if value.HasField("simple_value"):
        number = value.simple_value
    elif value.metadata.plugin_data.plugin_name == "scalars":
        number = float(tensor_util.make_ndarray(value.tensor))
    else:
        return False
    kind, stat, name = parsed
    stat = "param_norm" if (kind, stat) == (Kind.PARAM, "norm") else stat
    steps[step].setdefault(Key.of_label(kind, name), {})[stat] = number
    return True


def report_of(run: Run, thresholds: Thresholds) -> HealthReport:
    """The report of a run's statistics, steps in order."""
    report = HealthReport(thresholds)
    for step in sorted(run.parts):
        for part in run.parts[step]:
            report.add_stats(step, part)
    return report


def _flag_list(text: str) -> set[str]:
    chosen = {f.strip() for f in text.split(",") if f.strip()}
    unknown = chosen - set(FLAGS)
    if unknown:
        raise argparse.ArgumentTypeError(f"expected flags from {', '.join(FLAGS)}, got {', '.join(sorted(unknown))}")
    return chosen


# One plain sentence per threshold for --help (no markup: argparse prints it as it is).
_THRESHOLD_HELP = {
    "vanishing_ratio": "Flag vanishing when a gradient's RMS is below this share of the median RMS of its kind "
    "at the same step.",
    "vanishing_steps": "Flag vanishing only after this many logged steps in a row.",
    "vanishing_update_ratio": "Do not flag vanishing while the parameters it reaches still move by at least this "
    "share of the model's median update ratio.",
    "round_off_factor": "Note, not flag, a parameter whose gradient is below this many float round-offs of the "
    "gradient its module receives: zero by construction.",
    "exploding_factor": "Flag exploding when a gradient's RMS is this many times the median of its own last values.",
    "exploding_window": "Take that median over this many of its last logged values.",
    "exploding_steps": "Flag exploding only after this many logged steps in a row (update ratios too).",
    "exploding_update_ratio": "Flag exploding when an update ratio (the size of the step over the size of the "
    "weights) is above this.",
    "floor_ratio": "Ignore gradients and parameters whose RMS is below this share of the model's median at the "
    "step (zero- or tiny-initialised ones).",
    "dead_zero_fraction": "Flag dead when at least this share of a module's output and parameter gradients is zero.",
    "dead_steps": "Flag dead only after this many logged steps in a row.",
    "stalled_update_ratio": "Flag stalled when a parameter's update ratio is 0 or below this share of the model's "
    "median.",
    "stalled_steps": "Flag stalled only after this many logged steps in a row.",
    "scaler_skip_steps": ("A gradient scaler that skips every step for this many steps in a row, after it had "
                          "found a working scale, is nonfinite; fewer is a note."),
    "scaler_min_scale": "A gradient scaler whose scale falls below this while it skips steps is nonfinite.",
    "attention_logit_level": "Flag attention_logits when a module's maximum attention logit is above this and still "
    "rising.",
    "attention_steps": "Flag attention_logits only after this many rising logged steps in a row.",
    "activation_factor": "Flag activation_growth when an output's RMS is this many times its early level.",
    "activation_early_steps": "Take the early level as the median of this many first logged values of the output.",
    "activation_steps": "Flag activation_growth only after this many logged steps in a row.",
    "spike_factor": "Name a spike (spikes=True) when a step's gradient norm is this many times its recent median.",
    "spike_z": "Name a spike only when its norm is also this many robust standard deviations of the recent log norms above that median.",
    "spike_window": "Keep this many steps' gradient norms for the spike rule (saved with the callback's state).",
    "attention_logit_healthy": "An attention_logits flag's since is the step the logits went above this and stayed.",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_gradhooks",
        description="python -m lightning_gradhooks report LOGDIR: the gradient-health report of a logged run.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser(
        "report",
        help="print the gradient-health report of the runs under LOGDIR",
        description="Print the gradient-health report (flags: " + ", ".join(FLAGS) + ") of every run under "
        "LOGDIR (a folder holding TensorBoard event files written by GradHooks, searched recursively). "
        "Exit status: 0, or 1 when a flag named in --fail-on is present, 2 for a usage error or when "
        "LOGDIR holds no GradHooks data.",
    )
    report.add_argument("logdir", metavar="LOGDIR", type=Path, help="a run folder or a folder of runs")
    report.add_argument(
        "--fail-on",
        type=_flag_list,
        default=set(),
        metavar="FLAGS",
        help="comma-separated flags that make the command exit with status 1, e.g. nonfinite,exploding "
        "(default: none)",
    )
    report.add_argument("--all", action="store_true", help="print every flagged entry, not the grouped report")
    for f in fields(Thresholds):
        report.add_argument(
            f"--{f.name.replace('_', '-')}", type=int if f.type in (int, "int") else float, default=f.default,
            metavar="N" if f.type in (int, "int") else "X",
            help=f"{_THRESHOLD_HELP.get(f.name, 'A threshold of the report.')} Default: {f.default}.",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.logdir.is_dir():
        parser.error(f"LOGDIR expected an existing folder, got {str(args.logdir)!r}")
    try:
        thresholds = Thresholds(**{f.name: getattr(args, f.name) for f in fields(Thresholds)})
    except ValueError as error:
        name = str(error).split()[0].strip("`").removeprefix("Thresholds.")
        parser.error(f"argument --{name.replace('_', '-')}: {error}")
    folders = sorted({p.parent for p in args.logdir.rglob("events.out.tfevents.*")})
    runs = [read_folder(folder) for folder in folders]
    for run in runs:
        for d in run.damage:
            where = f" at byte {d.offset}" if d.offset >= 0 else ""
            print(
                f"warning: {d.path}: {d.reason}{where}; read {counted(d.events, 'event')} ({counted(d.steps, 'logged step')} of "
                "GradHooks data) before it, the rest is not in the report (a run still writing can end in "
                "a partial record)",
                file=sys.stderr,
            )
    with_data = [run for run in runs if run.gradhooks]
    if not with_data:
        what = f"{counted(len(folders), 'folder')} of event files, none with GradHooks tags" if folders else "no TensorBoard event files"
        print(f"error: no GradHooks data under {args.logdir} ({what}); nothing to report", file=sys.stderr)
        return 2
    failed = set()
    for run in with_data:
        report = report_of(run, thresholds)
        print(f"== {run.folder}\n{report.table(full=args.all)}")
        sentence = sentence_of(run.of(Key(Kind.NOISE, "gradient")))  # the gradient noise scale, as at the end of fit
        if sentence is not None:
            print(sentence)
        failed |= report.names(args.fail_on)
    skipped = [run.folder for run in runs if not run.gradhooks]
    if skipped:
        print(f"note: {counted(len(skipped), 'folder holds', 'folders hold')} event files without GradHooks tags: "
              + ", ".join(map(str, skipped[:5])), file=sys.stderr)
    if failed:
        print(f"failing on: {', '.join(sorted(failed))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
