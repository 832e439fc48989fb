"""Builds the optional C extension of stats.py; everything else is in pyproject.toml.

Where the extension cannot be built (no C compiler, not a POSIX system), the install goes on
without it and the statistics are reduced with torch ops, only slower.
"""

import os

from setuptools import Extension, setup

kernels = Extension(
    "lightning_gradhooks._kernels",
    ["lightning_gradhooks/_kernels.c"],
    # -fopenmp-simd: the simd pragmas vectorise the loops; no OpenMP runtime is linked.
    # -ffp-contract=off: the histogram's bin is computed in float32 as torch computes it.
    extra_compile_args=["-O3", "-fopenmp-simd", "-ffp-contract=off"],
    optional=True,
)

setup(ext_modules=[kernels] if os.name == "posix" else [])
