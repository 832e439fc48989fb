"""The host side, torch-free: what a step's statistics are and how they pool (:mod:`.statistics`),
the record and its summary (:mod:`.records`), the noise scale's estimate and advice
(:mod:`.noise`), the event files read back (:mod:`.events`), and the argument checks and text
helpers every layer shares (:mod:`.checks`, :mod:`.text`). Imports numpy, never torch, Lightning
or TensorBoard: the health report and ``python -m lightning_gradhooks report`` stand on it alone.
"""
