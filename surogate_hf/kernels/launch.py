"""Relaunching a compiled Triton kernel without JITFunction.run's per-call work.

`kernel[grid](*args)` binds and specializes every argument, builds a string cache key, checks the kernel's
globals and asks the driver for the device and stream on every call: tens of microseconds of Python per launch
on a slow host, and the recipes launch several kernels per linear per step. `FastLauncher` keeps, per
specialization, the CompiledKernel the first (ordinary) launch returned and calls its launcher directly
afterwards, with the same arguments in the same order; what it keys on is what Triton specializes on
(tensor dtype and 16-byte alignment, integers equal to 1 / divisible by 16 / beyond int32, and the
constexprs), so a relaunch can never pick a kernel compiled for other argument properties.

Taken only where it is known to be the same launch: Triton's CompiledKernel.run with the signature
(grid x3, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args) (Triton 3.2 to 3.6),
no launch hooks installed (profilers such as proton install them: then every launch goes the ordinary way), and
not under the interpreter. Anything else takes `kernel[grid](...)`.
"""

from __future__ import annotations

import inspect
import os

import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_MAX_I32 = 2**31 - 1


def _hooks_installed() -> bool:
    try:
        from triton import knobs

        return knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None
    except (ImportError, AttributeError):
        return True  # an older Triton: do not guess how its launches are wired


def _arg_key(v):
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return (v == 1, v % 16 == 0, v > _MAX_I32 or v < -_MAX_I32 - 1)
    if isinstance(v, float):
        return float
    return v  # a constexpr value (dtype, int, ...): part of the key as is


class FastLauncher:
    """`FastLauncher(kernel)(grid, *args, **constexprs_and_options)` == `kernel[grid](*args, **...)`.

    args: every non-constexpr parameter, positionally, in the kernel's order; keyword arguments: the constexprs
    and launch options (num_warps, ...). Defaults of the kernel's signature are filled in like Triton does.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        params = inspect.signature(kernel.fn).parameters
        self.names = list(params)
        self.defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
        self.cache = {}
        self.enabled = not _INTERPRET and not _hooks_installed()

    def __call__(self, grid, *args, **kw):
        if not self.enabled:
            return self.kernel[grid](*args, **kw)
        key = (tuple(map(_arg_key, args)), tuple(kw.items()), args[0].device.index if args else None)
        hit = self.cache.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, **kw)
            if compiled is None or not hasattr(compiled, "run") or not hasattr(compiled, "packed_metadata"):
                return compiled
            n_args = len(args)
            extra = [kw.get(n, self.defaults.get(n)) for n in self.names[n_args:]]
            self.cache[key] = (compiled, extra, args[0].device.index)
            return compiled
        compiled, extra, device = hit
        g = tuple(grid) + (1, 1)
        stream = torch._C._cuda_getCurrentRawStream(device)
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *extra)
        return compiled
