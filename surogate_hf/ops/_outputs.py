"""Every surogate:: op's Python kernel returns tensors of its own."""

from __future__ import annotations

import functools
import inspect

from torch import Tensor


def _own(t):
    """t, or where t is a view, a tensor over the same memory that is not one (no copy: the base is the kernel's own
    intermediate and dies with the call)."""
    if not (isinstance(t, Tensor) and t._is_view()):
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def fresh_outputs(fn):
    """`fn` with each output that is a view (a kernel's reshape or slice of its own intermediate) made a tensor of its
    own over the same memory.

    Compiled graphs take a fallback op's outputs as buffers of their own, and inductor may reuse one for a later graph
    output: a compiled loss came back as a view of an nvfp4 decode global, and the Trainer's in-place `loss *=` then
    failed. Applied where the ops are declared (their reference kernels) and where surogate_hf.kernels registers their
    CUDA kernels, so no kernel has to remember it."""

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        out = fn(*args, **kwargs)
        return tuple(_own(o) for o in out) if isinstance(out, tuple) else _own(out)

    # the schema is inferred from the signature: give it fn's, its annotations evaluated in fn's module
    del kernel.__wrapped__
    kernel.__signature__ = inspect.signature(fn, eval_str=True)
    return kernel
