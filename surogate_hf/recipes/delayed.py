"""Per-tensor delayed scaling (Transformer Engine DelayedScaling semantics), state kept as buffers.

One row per role (for a linear: input x, weight w, output gradient dy). For each cast of a role:
  1. the tensor is cast with the role's current `scale` (computed from earlier steps' amaxes);
  2. its amax (fused into the quantize op) is all-reduced with MAX over the data-parallel group
     when torch.distributed is initialised and `reduce_amax` is on, so every rank casts alike;
  3. the amax is pushed into the role's history (`amax_history[role, 0]` = newest, window length
     `amax_history_len`), a zero or non-finite amax is recorded as 0 ("no information");
  4. the next scale = fp8_max / A * 2^-margin with A = max over the window (MAX) or the newest
     entry (MOST_RECENT); A == 0 keeps the previous scale (formats.fp8_scale_from_amax).
Step 3 differs from TE in one respect: TE stores a NaN amax as is, which freezes the scale for the
whole window under MAX; recording 0 skips just that step.

Host cost: this runs for every cast of every converted linear, so the update is a fixed, short
chain of tensor ops with no Python branching on tensor values and no host sync (no .item()).
Roles of the same format cast together (x and W in a forward: `cast_group`) share one update:
their amaxes are stacked and pushed, reduced and turned into scales as one [n] tensor, which is
elementwise the same arithmetic as one role at a time.

`amax_history` and `scale` are persistent buffers: they are in state_dict, so checkpoints carry
them and a resumed run casts exactly as the uninterrupted one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import formats as F
from ..kernels import ops as _kernel_ops  # noqa: F401  (declares surogate::quantize_fp8_tensorwise_t)
from ..ops import quant as _quant_ops  # noqa: F401  (registers surogate::quantize_fp8_tensorwise)

_quantize = torch.ops.surogate.quantize_fp8_tensorwise
_quantize_t = torch.ops.surogate.quantize_fp8_tensorwise_t


_update = torch.ops.surogate.delayed_scaling_update


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _dp_all_reduce_max(amax: torch.Tensor) -> torch.Tensor:
    """In place: `amax` is a fresh tensor owned by the caller."""
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return amax


class DelayedScaling(nn.Module):
    def __init__(self, formats, history_len: int = 1024, algo: str = "max", margin: int = 0, reduce_amax: bool = True):
        super().__init__()
        if algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo={algo!r} is unknown; choose 'max' or 'most_recent'")
        self.formats = tuple(F.fp8_dtype(f) for f in formats)
        self.algo, self.margin, self.reduce_amax = algo, int(margin), bool(reduce_amax)
        n = len(self.formats)
        self.register_buffer("amax_history", torch.zeros(n, int(history_len), dtype=torch.float32))
        self.register_buffer("scale", torch.ones(n, dtype=torch.float32))
        self._last_scale = {}  # (first role, count) -> scales of the last training cast (checkpoint recomputes)

    def extra_repr(self) -> str:
        fmts = ", ".join(str(f).replace("torch.float8_", "") for f in self.formats)
        return f"formats=({fmts}), history={self.amax_history.shape[1]}, algo={self.algo}, margin={self.margin}"

    @torch.no_grad()
    def cast(self, role: int, x: torch.Tensor, mode: str = "train", transpose: bool = False):
        """Cast `x` for `role`; returns (q, scale_inv), or (q, qt, scale_inv) with `transpose`
        (qt = the contiguous transpose of q's 2D view, written by the same pass over x).

        mode "train": current scale, then the amax updates the state (and the scale used is remembered);
        "eval" (forwards without grad): current scale, state untouched, so evaluation never changes
        the training trajectory; "replay" (an activation-checkpointing recompute): the scale the
        original forward used and no update, so the recomputed operand equals the original one.
        """
        (out,), sinv = self.cast_group(role, (x,), mode, (transpose,))
        return (*out, sinv[0])

    @torch.no_grad()
    def cast_group(self, first: int, xs, mode: str = "train", transposes=None):
        """Cast xs[i] for role first + i (all of one FP8 format) with one shared state update.

        Returns ([(q,) or (q, qt) per tensor], scale_inv [len(xs)]), index scale_inv for each role.
        """
        n = len(xs)
        transposes = transposes or (False,) * n
        fmt = self.formats[first]
        if any(f != fmt for f in self.formats[first : first + n]) or first + n > len(self.formats):
            raise ValueError(f"cast_group: roles {first}..{first + n - 1} must exist and share one FP8 format")
        key = (first, n)
        if mode == "replay" and key in self._last_scale:
            scales = self._last_scale.pop(key)
            return self._quantize_all(xs, scales, fmt, transposes)[0], scales.reciprocal()
        live = self.scale[first : first + n]
        # eval leaves the state alone, so the live scales can be read directly; otherwise snapshot
        # them: the update below overwrites them, and a replay needs the ones this cast used.
        scales = live if mode == "eval" else live.clone()
        outs, amaxes = self._quantize_all(xs, scales, fmt, transposes)
        if mode == "train":
            self._last_scale[key] = scales
        if mode != "eval":  # a replay with nothing to replay (reentrant checkpoint: first pass ran without grad)
            self._push(first, amaxes[0].reshape(1) if n == 1 else torch.stack(amaxes))
        return outs, scales.reciprocal()

    @staticmethod
    def _quantize_all(xs, scales, fmt, transposes):
        outs, amaxes = [], []
        for i, (x, t) in enumerate(zip(xs, transposes)):
            if t:
                q, qt, amax = _quantize_t(x, scales[i], fmt)
                outs.append((q, qt))
            else:
                q, amax = _quantize(x, scales[i], fmt)
                outs.append((q,))
            amaxes.append(amax)
        return outs, amaxes

    @torch.no_grad()
    def update(self, role: int, amax: torch.Tensor) -> None:
        """Push one amax for `role` and compute its next scale (what a training cast does after casting)."""
        self._push(role, amax.detach().reshape(1))

    def _push(self, first: int, amax: torch.Tensor) -> None:
        """amax [n] fp32 for roles first..first+n-1: sanitize, all-reduce, push, rescale (one fused kernel on
        CUDA: surogate::delayed_scaling_update, whose reference is the spec of steps 3 and 4 above)."""
        n = amax.shape[0]
        if self.reduce_amax and _distributed():
            # sanitized before the reduction so one rank's NaN cannot poison the others (the op sanitizes again)
            amax = _dp_all_reduce_max(torch.nan_to_num(amax.float(), nan=0.0, posinf=0.0, neginf=0.0))
        _update(self.amax_history[first : first + n], self.scale[first : first + n], amax.float(),
                self.formats[first], self.margin, self.algo == "max")
