"""``python -m lightning_gradhooks report LOGDIR``: the gradient-health report of a logged run.

Reads the TensorBoard event files under ``LOGDIR`` (each folder holding event files is one run),
checking every record's length and CRC-32C as TensorBoard writes them, rebuilds every logged
step from the compact summary GradHooks writes at each (``gradhooks/stats``: packed numbers in an
event of its own) and prints the report of :mod:`lightning_gradhooks.health`. Works while the run
is still going. Imports neither torch, Lightning nor TensorBoard (:mod:`lightning_gradhooks.summary.events`
reads the files): it starts in a fraction of a second, on a machine without torch too. A file that is cut short or damaged is read up to the damage, and
a warning names it and says what was read.

Exit status: 0 (no flag named in ``--fail-on``), 1 (a flag named in ``--fail-on`` was found),
2 (a usage error, or no GradHooks data under ``LOGDIR``).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from lightning_gradhooks.health import FLAGS, HealthReport, Thresholds
from lightning_gradhooks.health.thresholds import help_of
from lightning_gradhooks.health.step import Packed, merge_summary
from lightning_gradhooks.summary.events import OVERVIEW, STATS_TAG, Damage, SummaryReader, read_event, read_records
from lightning_gradhooks.summary.noise import sentence_of
from lightning_gradhooks.summary.records import Key, Kind, Summary
from lightning_gradhooks.summary.text import counted


@dataclass
class Run:
    """What the event files of one run folder hold: the GradHooks statistics of each logged step
    as written (its summaries, laid end to end: the update ratios come in one of their own,
    after the gradients), in the order they were written, and the damage met while reading."""

    folder: Path
    parts: dict[int, list[Packed]]
    gradhooks: bool
    damage: list[Damage]

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

    Once a file is seen to hold compact summaries (each an event of its own), its other events
    (charts, histograms) are skipped without being parsed: the summaries hold all the report
    reads, and are kept as they are, numbers in an array (:class:`~lightning_gradhooks.health.step.Packed`).

    A run resumed from a checkpoint writes a new file into the same folder; where it logs a step
    that an earlier file holds already (a checkpoint older than the last logged step), the
    earlier file's steps from there on are dropped, as TensorBoard drops them: what the resumed
    run logged replaces them, and the report is the resumed run's own."""
    run = Run(folder, defaultdict(list), False, [])
    for path in sorted(folder.glob("events.out.tfevents.*")):
        _read_file(path, run)
    run.parts = dict(run.parts)
    return run


def _read_file(path: Path, run: Run) -> None:
    """Add the GradHooks data of one event file to ``run``."""
    parts, events, logged, reader = run.parts, 0, set(), SummaryReader()
    plans: dict[int, tuple[list[Key], list[int], list[str]]] = {}  # each layout's keys, lengths and names
    restart: int | None = None  # the first step of this file with a summary
    for record in read_records(path):
        if isinstance(record, Damage):
            record.events, record.steps = events, len(logged)
            run.damage.append(record)
            return
        events += 1
        if restart is not None and _STATS_BYTES not in record[:_STATS_WITHIN]:
            continue  # charts: not what the report reads
        try:
            step, values = read_event(record)
        except (ValueError, IndexError, UnicodeDecodeError) as error:  # a record whose CRC holds but whose bytes are no event
            run.damage.append(Damage(path, -1, f"a record is no event ({type(error).__name__})", events - 1, len(logged)))
            return
        for value in values:
            run.gradhooks = run.gradhooks or value.tag.startswith(OVERVIEW + "/")
            found = reader.read_packed(value)
            if found is None:
                continue
            if restart is None:
                restart = step
                for stale in [s for s in parts if s >= restart]:
                    del parts[stale]
            plan, numbers = found  # a step's update ratios come in a summary of their own, later
            laid = plans.get(id(plan))
            if laid is None:
                laid = plans[id(plan)] = ([key for key, _ in plan], [len(names) for _, names in plan],
                                          [name for _, names in plan for name in names])
            parts[step].append(Packed(*laid, np.frombuffer(numbers, dtype=np.float64)))
            run.gradhooks = True
            logged.add(step)


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
            help=f"{help_of(f.name)} Default: {f.default}.",
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
        noise = Key(Kind.NOISE, "gradient")  # the gradient noise scale, as at the end of fit
        sentence = sentence_of({step: summary[noise] for step, summary in run.of(noise).items()})
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
