"""GPTQ rounding for surogate_hf quantized bases: codes chosen to minimise each layer's output error.

Round-to-nearest picks every code on its own. GPTQ (Frantar et al. 2023) rounds the weight's columns one at a time
and moves each column's rounding error onto the columns not yet rounded, in proportion to how the layer's inputs
correlate, which minimises ||(W - deq(Q)) X|| over calibration inputs X instead of ||W - deq(Q)||. It needs only
H = E[x x^T], the input second moment `loftq_init(calibration=...)` already collects, so it is that function's
`quantizer="gptq"` option (integrations/loftq.py): the activation-aware adapters then fit what GPTQ leaves.

The scales stay the format's own (`Format.quantize` on the dense weight: NVFP4's 4/6 choice, MXFP4's E8M0
exponents, NF4's searched block scales and their double quantization, FP8's 128x128 blocks); only the codes change,
through `Format.element_scales`, `round_to_grid` and `encode_on_scales`. This is GPTQ with static groups
(AutoGPTQ's `static_groups`), which is what lets the columns go in order of decreasing input energy
(`act_order`): every block scale is fixed before its columns are reached. The result is a plain tensor of the
format, read by every decoder of it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


@torch.no_grad()
def gptq_round(w: Tensor, h: Tensor, scales: Tensor, round_to_grid, block: int = 128, act_order: bool = True) -> Tensor:
    """The GPTQ rounding of w [n, k] onto the grid `round_to_grid(v / scales) * scales` (scales [n, k] fixed).

    h: [k, k] input second moment, already damped (positive definite). Returns the rounded values [n, k] fp32;
    with h diagonal (uncorrelated inputs) they are round-to-nearest's."""
    n, k = w.shape
    if tuple(h.shape) != (k, k):
        raise ValueError(f"gptq: input second moment of shape {tuple(h.shape)} given for a weight with {k} columns")
    if tuple(scales.shape) != (n, k):
        raise ValueError(f"gptq: element scales of shape {tuple(scales.shape)} given for a ({n}, {k}) weight")
    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else torch.arange(k, device=h.device)
    w, scales = w.float()[:, perm], scales.float()[:, perm]  # fresh tensors: w is updated in place below
    safe = torch.where(scales != 0, scales, torch.ones_like(scales))
    h = h.double()[perm][:, perm]

    def rnd(col, j):  # a zero scale (an all-zero block) decodes every code to 0
        return torch.where(scales[:, j] != 0, round_to_grid(col / safe[:, j]) * scales[:, j], torch.zeros_like(col))

    # U = the upper Cholesky factor of H^-1: row j of U (from j on) spreads column j's error over the later ones
    try:
        u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    except torch.linalg.LinAlgError as exc:
        raise ValueError("gptq: the input second moment is not positive definite; raise the damping") from exc
    q = torch.empty_like(w)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, ub = w[:, b0:b1], u[b0:b1, b0:b1]
        err = torch.empty_like(wb)
        for i in range(b1 - b0):
            col = wb[:, i]
            qi = rnd(col, b0 + i)
            q[:, b0 + i] = qi
            e = (col - qi) / ub[i, i]
            wb[:, i + 1 :] -= e[:, None] * ub[i, i + 1 :][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ u[b0:b1, b1:]  # the block's errors onto every later column at once ("lazy batch")
    return q[:, torch.argsort(perm)]


@torch.no_grad()
def gptq_quantize(base: nn.Module, w: Tensor, h: Tensor, block: int = 128, act_order: bool = True) -> dict[str, Tensor]:
    """Quantize the dense w [out, in] for the quantized linear `base` with GPTQ codes on the format's own scales
    (see the module doc). Returns {slot name: tensor} like `base.quantize_weight`, without touching `base`."""
    n, k = base.out_features, base.in_features
    slots = base.quantize_weight(w)
    t = {name[len("weight") :]: v for name, v in slots.items()}
    fmt = base.fmt
    wq = gptq_round(w.to(device=h.device, dtype=torch.float32), h, fmt.element_scales(t, n, k).to(h.device),
                    fmt.round_to_grid, block, act_order)
    t = fmt.encode_on_scales(t, wq.to(w.device), n, k)
    return {"weight" + s: v for s, v in t.items()}
