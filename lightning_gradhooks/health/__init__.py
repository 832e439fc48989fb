"""The gradient-health report: what looks wrong, where, since when, and why. Python, with numpy arrays.

The :class:`~lightning_gradhooks.health.judge.Judge` takes in the summary of each logged step
(:func:`~lightning_gradhooks.summary.records.step_summary`: from the callback, a plain loop or Fabric, or
read back from a TensorBoard log by the ``report`` command: the same numbers, so the same flags)
and runs its checks over it; :class:`~lightning_gradhooks.health.report.HealthReport` holds a
judge and renders what it decided. The flags, worst first:

- ``nonfinite`` (:mod:`.nonfinite`): NaN/Inf, or a gradient whose L2 norm overflows float32
  (what ``clip_grad_norm_`` then sees as an infinite total norm), or a non-finite update. One
  row: the first logged step where it appears and where it was born
  (:func:`~lightning_gradhooks.health.origin.nonfinite_origin`). A step whose gradient scaler
  caught its NaN/Inf and skipped it is the scaler's business (:mod:`.scaler`): counted in a note,
  and ``nonfinite`` only once the skipping persists.
- ``exploding`` (:mod:`.exploding`, :mod:`.exploding_updates`, :mod:`.exploding_at_nonfinite`):
  a gradient many times its own recent median, or an update many times the weights it moves.
- ``attention_logits`` (:mod:`.attention_logits`): a maximum attention logit past a level no
  healthy run reaches, still rising (``attention_logit`` entries).
- ``activation_growth`` (:mod:`.activation_growth`): a module output's RMS many times its early
  level (``output`` entries: ``activations=True``); rows downstream of where it began fold under it.
  A gradient row (non-finite, exploding, stalled) that follows one of these two flags on its
  module or upstream of it says so (:func:`~lightning_gradhooks.health.rows.upstream_or_same`).
- ``vanishing`` (:mod:`.vanishing`): a gradient far below the model's median of its kind, while
  its parameters stop moving too.
- ``dead`` (:mod:`.dead`): a module whose output and parameter gradients are all zero.
- ``stalled``: a parameter that does not move (:mod:`.stalled`), with its causes where there is
  one: in no optimizer (:mod:`.unowned`), no gradient (:mod:`.no_gradient`), a cut learning
  rate (:mod:`.lr_cut`).
- notes, never flags (:mod:`.round_off`): parameters whose gradient is zero by construction;
  a check's own line (:meth:`~lightning_gradhooks.health.check.Check.note`: the scaler's skipped steps).

Why each definition is what it is (docs/validation.md has the validation): gradients are compared with
the model's own scale at the same step, or with their own recent median, never with zero or with
one past value; an RMS (:func:`~lightning_gradhooks.summary.records.rms`) is taken over the non-zero
elements only, so that embedding rows and timesteps that no example touches do not read as
small; a flag needs several logged steps in a row, so a single-step spike is not one. Every
statistic is judged rounded to float32 (:meth:`~lightning_gradhooks.health.step.Packed.of`), so the
report of a record and the report of its log (which holds float64) agree. A check whose
statistic was not logged is skipped.

Writing a check
---------------

A check is one file here holding one subclass of :class:`~lightning_gradhooks.health.check.Check`,
and one line in :data:`~lightning_gradhooks.health.judge.CHECKS`:

- **What it receives.** ``Check(thresholds)`` once per judge; then, once per logged step,
  ``check(step, tracker)``: the :class:`~lightning_gradhooks.health.step.Step` (the step's
  entries, rounded and merged; each key's subject; the non-finite entries; per-kind median RMS;
  what "moving" means; the model's backward order and parameter sizes) and the
  :class:`~lightning_gradhooks.health.tracker.Tracker`. What a check needs of a whole step (a
  median, a vectorised pass) is a cached property of ``Step``, computed once for every check.
- **Judging a step at once.** A step is judged in arrays, not entry by entry (the report
  command judges hundreds of thousands of entries): its numbers come as one array
  (:class:`~lightning_gradhooks.health.step.Packed`: from the log, they stay numbers from the
  file to the checks); ``step.layout`` (:class:`~lightning_gradhooks.health.step.Layout`, made
  once per set of keys: the keys, their subjects, labels, modules, module ids and kinds side by
  side), ``step.column(statistic, missing)`` (one statistic of every entry, a float64 array in
  record order), ``step.finite`` (the entries not in ``bad``), ``step.gradients`` (the finite
  gradient entries with their RMS and their kind's median), ``step.updates`` (the update
  ratios), ``step.moving`` (bool per entry). ``step.entries`` (the dicts) are made on first use
  and ``step.entry(i)`` gives one: for what concerns a few entries (a non-finite step, a scaler).
- **What it may write.** Flags only through ``tracker.run(flag, subject, step, bad, needed,
  value, ...)`` (a run of ``needed`` bad steps raises the flag; ``reason`` for a cause of its
  own), ``tracker.run_many(flag, subjects, labels, step, bad, needed, values, scores)`` (many
  subjects at once: ``bad`` their positions, the values and scores arrays; the runs are arrays
  per flag, and the labels cost nothing when the list is the same object at every step:
  ``step.layout.chosen(positions)`` gives it) or ``tracker.promote``; notes in
  ``tracker.notes`` (a parameter's), or
  one line of the check's own from its ``note()``; the first non-finite row in
  ``tracker.nonfinite``. What it tells the checks after it: a field of ``Step``, declared and
  documented there (``scaler_skipped``, ``unowned``, ``round_off``, ``no_gradient``, ``lr_cut``,
  ``first_nonfinite``): add a field there rather than reading another check's state.
- **How it is ordered.** ``CHECKS`` is the order: a check comes after every check whose
  ``Step`` fields it reads (the comments there say who writes and who reads what). Within one
  flag, flags are listed in the order they were first raised, so a new check keeps its place
  in the tuple.
- **How it saves state.** State lives in the check's own attributes; ``state_dict()`` returns it
  as plain Python values and ``load_state_dict(state)`` takes it back, under the check's
  ``name`` in the judge's state. A check absent from a checkpoint (added in a later release)
  starts fresh.
- **How it is rendered.** Rows are grouped from the tracker's flags by
  :mod:`~lightning_gradhooks.health.rows` and rendered by
  :mod:`~lightning_gradhooks.health.report`; a new flag name goes in
  :data:`~lightning_gradhooks.health.flags.FLAGS`.
- **How it is tested.** ``tests/health/test_<check>.py``, driving the check with hand-made
  steps (``tests/health/steps.py``).
"""

from lightning_gradhooks.health.flags import FLAGS, Flag, Row
from lightning_gradhooks.health.judge import CHECKS, Judge
from lightning_gradhooks.health.origin import nonfinite_origin
from lightning_gradhooks.health.report import HealthReport
from lightning_gradhooks.health.thresholds import Thresholds

__all__ = ["CHECKS", "FLAGS", "Flag", "HealthReport", "Judge", "Row", "Thresholds", "nonfinite_origin"]
