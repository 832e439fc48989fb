"""The statistics' kernels compiled once per process with ``torch.compile``, or run eagerly.

:func:`run` calls one of :mod:`~lightning_gradhooks.core.stats`' row functions (plain torch ops) on a
block of rows. Where Inductor can compile for the block's device (a C++ compiler on the CPU,
Triton on CUDA) the function is compiled once per process, with the row count dynamic, so a
process compiles one kernel per function and dtype whatever the model (and a second one when a
tensor's dtype or the bin count changes); the compiled code is reused by every monitor, and
Inductor's on-disk cache makes the next process's compile quick. Elsewhere (Windows, no Inductor,
no compiler, ``torch.compile`` disabled by the user with ``TORCH_COMPILE_DISABLE=1`` or
``torch._dynamo.config.disable``, or a compile that raises) an eager counterpart runs instead (the
same numbers from fewer, bigger ops: :mod:`~lightning_gradhooks.core.stats`), and
the ``lightning_gradhooks`` logger says so once at INFO; it also says, once per process at INFO,
that the first compile begins and how long it usually takes. Nothing here changes a ``torch.compile``
or Dynamo setting: options are per call.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import shutil
import sys
from collections.abc import Callable

import torch
from torch import Tensor

log = logging.getLogger("lightning_gradhooks")

#: Rows per call of a compiled source run eagerly (:func:`rows_at_a_time`): its ops write
#: temporaries of this many rows (4 MiB in float32).
EAGER_ROWS = 1024

# Process-wide: the compiled function per (function, device type), or the function itself where
# it runs eagerly; what was already logged (the reasons, and "compile" once the first compile was announced).
_compiled: dict[tuple[Callable, str], Callable] = {}
_said: set[str] = set()
#: Row functions that scatter (:func:`scatter`).
_scatters: set[Callable] = set()
#: Rows per call of a scatter's compiled code on the CPU with more than one thread (:func:`scatter`).
SCATTER_ROWS = 1024


def scatter(function: Callable) -> Callable:
    """Mark a row function that scatters. In parallel code on the CPU (compiled with more than one
    torch thread) Inductor does not fuse a scatter: it writes the index out as int64 and calls
    aten's ``scatter_add_``, and on a block of 4,096 rows of 1,024 float32 that took 15.6-16.3 ms at
    2 threads on a 2-vCPU machine, against 6.2 ms called on :data:`SCATTER_ROWS` rows at a time
    (their index stays in cache) and 7.0 ms for the fused kernel that one thread compiles (which
    is called on whole blocks: each call costs about 0.2 ms more). So while torch has more than
    one thread, its compiled code on the CPU is called on at most :data:`SCATTER_ROWS` rows at a
    time. The numbers do not change. Returns ``function`` itself."""
    _scatters.add(function)
    return function


def unavailable(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot compile the statistics for ``device_type`` here, or None."""
    if sys.platform == "win32":
        return "torch.compile's Inductor is not used on Windows here"
    if os.environ.get("TORCH_COMPILE_DISABLE", "0") not in ("", "0") or torch._dynamo.config.disable:
        return "torch.compile is disabled (TORCH_COMPILE_DISABLE or torch._dynamo.config.disable)"
    try:
        importlib.import_module("torch._inductor")
    except ImportError as error:  # a build of torch without Inductor
        return f"Inductor does not import ({error})"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed"
    if device_type == "cpu":
        compiler = os.environ.get("CXX", "g++")
        return None if shutil.which(compiler) or shutil.which("clang++") else f"no C++ compiler ({compiler}) on PATH"
    return None  # other devices: try, and fall back if the compile raises


def _say(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        log.info("lightning_gradhooks: gradient statistics run as eager torch ops: %s", reason)


def _kernel(function: Callable, device_type: str) -> Callable:
    key = (function, device_type)
    if key not in _compiled:
        reason = unavailable(device_type)
        if reason:
            _say(reason)
        elif "compile" not in _said:  # the first compile of the process: it takes a while, say so before
            _said.add("compile")
            log.info("lightning_gradhooks: compiling the gradient statistics with torch.compile, once per process: "
                     "usually 10-30 s in a first run, a few seconds once Inductor's on-disk cache is warm "
                     "(compile_statistics=False: no compile, slower statistics)")
        _compiled[key] = function if reason else _compile(function)
    return _compiled[key]


def _compile(function: Callable) -> Callable:
    return torch.compile(function, fullgraph=True)


def run(function: Callable[..., Tensor], eager: Callable[..., Tensor], compiled: bool, x: Tensor, *rows: Tensor,
        **constants: int) -> Tensor:
    """``function(x, *rows, **constants)`` on a block ``x`` of shape ``(rows, width)`` (and
    per-row tensors ``rows``), compiled where possible if ``compiled`` (and no dispatch or function
    mode of the caller's is active); else ``eager(x, *rows, **constants)``: the same numbers from
    a sequence of ops that is fast without a compiler. The first dimension is dynamic: every
    block shape shares one compiled kernel.
    """
    with torch.no_grad():  # one guard set whether called in backward or after it
        if compiled and not _modes_active():
            kernel = _kernel(function, x.device.type)
            if kernel is not function:
                try:
                    with _without_autocast(x.device.type):
                        call = functools.partial(_call, kernel)
                        if function in _scatters and x.device.type == "cpu" and torch.get_num_threads() > 1:
                            return rows_at_a_time(call, x, *rows, rows_per_call=SCATTER_ROWS, **constants)
                        return call(x, *rows, **constants)
                except Exception as error:  # a compiler that fails: eager from now on, said once
                    _compiled[function, x.device.type] = function
                    _say(f"torch.compile raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        return eager(x, *rows, **constants)


def rows_at_a_time(function: Callable[..., Tensor], x: Tensor, *rows: Tensor, rows_per_call: int = EAGER_ROWS,
                   **constants: int) -> Tensor:
    """``function`` on ``rows_per_call`` rows at a time (one call where the block has no more): a
    compiled source run as it is, eagerly, :data:`EAGER_ROWS` rows at a time, or a scatter's
    compiled code in parallel CPU code (:func:`scatter`)."""
    parts = [function(x[r : r + rows_per_call], *(t[r : r + rows_per_call] for t in rows), **constants)
             for r in range(0, len(x), rows_per_call)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _without_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off around a compiled kernel (a ``collect`` inside the caller's ``autocast``
    block): its state is part of what a compiled kernel is guarded on, so each new state would
    compile the kernels again. The statistics' ops keep their dtypes either way."""
    types = {device_type, "cpu"}
    if not any(torch.is_autocast_enabled(t) for t in types):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for t in types:
        stack.enter_context(torch.autocast(t, enabled=False))
    return stack


def _modes_active() -> bool:
    """A Python dispatch or function mode of the caller's (an op counter, a debug mode) is active:
    compiled code would not run under it, so this call runs the eager ops, and later calls
    compile as usual."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None or torch._C._is_torch_function_mode_enabled()


def _call(kernel: Callable, x: Tensor, *rows: Tensor, **constants: int) -> Tensor:
    # Dynamo specializes sizes 0 and 1: a lone row gets a NaN row beside it (not counted).
    n = len(x)
    if n < 2:
        x = torch.cat([x, x.new_full((2 - n, x.shape[1]), float("nan"))])
        rows = tuple(torch.cat([t, t.new_zeros((2 - n, *t.shape[1:]))]) for t in rows)
    for t in (x, *rows):
        torch._dynamo.mark_dynamic(t, 0)
    out = kernel(x, *rows, **constants)
    return out[:n] if n < 2 else out
