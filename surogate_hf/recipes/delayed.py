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

`amax_history` and `scale` are persistent buffers: they are in state_dict, so checkpoints carry
them and a resumed run casts exactly as the uninterrupted one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import formats as F
from ..ops import quant as _quant_ops  # noqa: F401  (registers surogate::quantize_fp8_tensorwise)


def _dp_all_reduce_max(amax: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        amax = amax.clone()
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
        self._last_scale = {}  # role -> scale of the last training cast (for checkpoint recomputes)

    def extra_repr(self) -> str:
        fmts = ", ".join(str(f).replace("torch.float8_", "") for f in self.formats)
        return f"formats=({fmts}), history={self.amax_history.shape[1]}, algo={self.algo}, margin={self.margin}"

    @torch.no_grad()
    def cast(self, role: int, x: torch.Tensor, mode: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Cast `x` for `role`; returns (q, scale_inv).

        mode "train": current scale, then the amax updates the state (and the scale used is remembered);
        "eval" (forwards without grad): current scale, state untouched, so evaluation never changes
        the training trajectory; "replay" (an activation-checkpointing recompute): the scale the
        original forward used and no update, so the recomputed operand equals the original one.
        """
        if mode == "replay" and role in self._last_scale:
            scale = self._last_scale.pop(role)
            q, _ = torch.ops.surogate.quantize_fp8_tensorwise(x, scale, self.formats[role])
            return q, scale.reciprocal()
        scale = self.scale[role].clone()
        q, amax = torch.ops.surogate.quantize_fp8_tensorwise(x, scale, self.formats[role])
        if mode == "train":
            self._last_scale[role] = scale
        if mode != "eval":  # a replay with nothing to replay (reentrant checkpoint: first pass ran without grad)
            self.update(role, amax)
        return q, scale.reciprocal()

    @torch.no_grad()
    def update(self, role: int, amax: torch.Tensor) -> None:
        amax = amax.detach().float().reshape(())
        amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
        if self.reduce_amax:
            amax = _dp_all_reduce_max(amax)
        hist = self.amax_history[role]
        hist.copy_(torch.roll(hist, 1))
        hist[0] = amax
        window = hist.amax() if self.algo == "max" else hist[0]
        self.scale[role] = F.fp8_scale_from_amax(window, self.formats[role], self.margin, previous=self.scale[role])
