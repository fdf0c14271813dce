"""LoftQ-style LoRA initialisation for surogate_hf quantized bases: adapters that cancel the quantization error.

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=SurogateConfig(format="nvfp4"))
    model = prepare_for_training(model)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    surogate_hf.loftq_init(model, path, iters=2)      # path: the bf16 checkpoint the model was loaded from
    surogate_hf.loftq_init(model, path, calibration=[input_ids, ...])   # or: fit each layer's outputs

For every LoRA layer over a surogate quantized linear (fp8, nvfp4, mxfp4, nf4), with W the bf16 weight,
Q the layer's own quantizer and s the adapter's scaling (lora_alpha / r, or its rsLoRA value), it
alternates (LoftQ, Li et al. 2023, algorithm 1):

    Q_t   = Q(W - s * B_{t-1} A_{t-1})            (B_0 A_0 = 0, so Q_1 = Q(W), the plain base)
    B_t, A_t = rank-r SVD of (W - deq(Q_t)) / s    (sqrt of the singular values on each side)

and keeps the iterate with the smallest ||W - (deq(Q_t) + s * B_t A_t)||_F, so the result is never worse
than one iteration, which is never worse than the plain init (B = 0). The base layer's packed weight and
scales are replaced by Q_t, the adapters by A_t, B_t (in the adapters' own dtype).

With `calibration=` (batches of training inputs) the fit is activation-aware instead: each layer's input second
moment H = E[x x^T] is collected by forward hooks, and B A minimises the layer's output error over those inputs,
||(W - deq(Q) - s B A) H^(1/2)||_F: the rank-r SVD of (W - deq(Q)) H^(1/2), mapped back by H^(-1/2) (QERA,
Zhang et al. 2024). `quantizer="gptq"` also replaces Q's round-to-nearest by GPTQ codes on the format's own scales
(integrations/gptq.py), fitted to the same H. On the convergence benchmark's real model the weight-space fit raised
the step-0 loss of nvfp4 QLoRA while lowering every layer's output error; the activation-aware fit lowered it
(docs/fidelity.md).

The quantized model no longer holds W, so the dense weights must be given: a checkpoint directory or
.safetensors file (read lazily, one tensor at a time, like PEFT's `replace_lora_weights_loftq`), a state
dict, or the dense model itself; by default the directory the model was loaded from
(`config._name_or_path`). PEFT's own `init_lora_weights="loftq"` covers bitsandbytes NF4 only.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from ..nn import slots as S
from .gptq import gptq_quantize

_PEFT_PREFIX = "base_model.model."
QUANTIZERS = ("round", "gptq")


class _CheckpointWeights(Mapping):
    """The tensors of a safetensors checkpoint (directory or file), opened on demand."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self._open = safe_open
        p = Path(path)
        if p.is_dir():
            index = p / "model.safetensors.index.json"
            if index.exists():
                weight_map = json.loads(index.read_text())["weight_map"]
                self._where = {k: p / f for k, f in weight_map.items()}
            else:
                files = sorted(p.glob("*.safetensors"))
                if not files:
                    raise FileNotFoundError(f"loftq_init: no .safetensors file in {p} (the dense weights are needed)")
                self._where = {}
                for f in files:
                    with safe_open(str(f), framework="pt") as sf:
                        self._where.update({k: f for k in sf.keys()})
        elif p.is_file() and p.suffix == ".safetensors":
            with safe_open(str(p), framework="pt") as sf:
                self._where = {k: p for k in sf.keys()}
        else:
            raise FileNotFoundError(
                f"loftq_init: {path} is neither a checkpoint directory nor a .safetensors file; pass the bf16 "
                f"checkpoint the model was loaded from, a state dict or the dense model"
            )

    def __getitem__(self, key: str) -> Tensor:
        with self._open(str(self._where[key]), framework="pt") as sf:
            return sf.get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def _dense_weights(peft_model: nn.Module, weights) -> Mapping:
    if weights is None:
        cfg = getattr(peft_model, "config", None)
        path = getattr(cfg, "_name_or_path", None) or getattr(peft_model, "name_or_path", None)
        if not path or not Path(path).exists():
            raise ValueError(
                "loftq_init: the model was not loaded from a local checkpoint directory; pass weights= (a checkpoint "
                "directory or .safetensors file, a state dict, or the dense model)"
            )
        return _CheckpointWeights(path)
    if isinstance(weights, (str, os.PathLike)):
        return _CheckpointWeights(weights)
    if isinstance(weights, nn.Module):
        return weights.state_dict()
    if isinstance(weights, Mapping):
        return weights
    raise TypeError(f"loftq_init: weights must be a path, a state dict or a module, got {type(weights).__name__}")


def _low_rank_factors(e: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """(L [n, r], R [r, k]) with L @ R the best rank-r approximation of e (Eckart-Young), sqrt of the singular
    values on each side. Through the eigendecomposition of the smaller Gram matrix in float64: the same
    factors as a truncated SVD for the leading singular values, several times faster than a full fp32 SVD
    on CPU, and the float64 Gram keeps the leading directions exact to far below the quantization error."""
    n, k = e.shape
    e64 = e.double()
    gram = e64.T @ e64 if n >= k else e64 @ e64.T
    evals, vecs = torch.linalg.eigh(gram)  # ascending
    evals, vecs = evals.flip(0)[:rank].clamp_min(0), vecs.flip(1)[:, :rank]
    sv = evals.sqrt()
    inv_root = torch.where(sv > 0, sv.rsqrt(), torch.zeros_like(sv))
    if n >= k:  # vecs = V_r: e @ V_r = U_r S_r
        left, right = (e64 @ vecs) * inv_root, sv.sqrt()[:, None] * vecs.T
    else:  # vecs = U_r: U_r^T e = S_r V_r^T
        left, right = vecs * sv.sqrt(), inv_root[:, None] * (vecs.T @ e64)
    return left.float(), right.float()


def _frob_error(w: Tensor, deq: Tensor, lr: Tensor | None, root: Tensor | None = None) -> float:
    """||W - deq - lr|| / ||W||, in the metric of the input second moment when root = H^(1/2) is given (the
    relative error of the layer's output over the calibration inputs)."""
    d = w - deq if lr is None else w - deq - lr
    if root is not None:
        d, w = d.double() @ root, w.double() @ root
    return float(d.norm() / w.norm().clamp_min(1e-30))


def damped(second_moment: Tensor, damp: float) -> Tensor:
    """The input second moment H + damp * mean(diag H) * I, in float64. The damping keeps directions the
    calibration never excited from getting unbounded weight (in H^(-1/2), and in GPTQ's H^-1)."""
    h = second_moment.double()
    return h + damp * h.diagonal().mean().clamp_min(1e-30) * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)


def input_metric(second_moment: Tensor, damp: float) -> tuple[Tensor, Tensor]:
    """(H^(1/2), H^(-1/2)) in float64 of the damped input second moment (`damped`; symmetric roots through one
    eigendecomposition)."""
    evals, vecs = torch.linalg.eigh(damped(second_moment, damp))
    evals = evals.clamp_min(evals.max() * 1e-12)
    return (vecs * evals.sqrt()) @ vecs.T, (vecs * evals.rsqrt()) @ vecs.T


@torch.no_grad()
def loftq_decompose(base: nn.Module, w: Tensor, rank: int, scaling: float, iters: int = 1,
                    metric: tuple[Tensor, Tensor] | None = None, gptq_moment: Tensor | None = None):
    """Alternate quantize / SVD for one quantized linear `base` and its dense weight `w` [out, in].

    metric: (H^(1/2), H^(-1/2)) of the layer's input second moment (input_metric), or None. With it the rank-r fit
    minimises the output error over those inputs, ||(E - s B A) H^(1/2)||_F, whose minimiser is the truncated
    SVD of E H^(1/2) mapped back by H^(-1/2) (activation-aware, as in QERA, Zhang et al. 2024); without it the
    weight error ||E - s B A||_F (LoftQ). Errors and the choice of iterate use the same metric.
    gptq_moment: the damped input second moment H (`damped`), or None. With it each quantization is GPTQ's
    (integrations/gptq.py: codes that minimise the output error on the format's own scales) instead of the
    format's round-to-nearest.
    Returns (slots {buffer name: tensor} to load into base, A [rank, in], B [out, rank] in fp32, errors) where
    errors = {"plain": relative error of deq(Q(w)) alone (GPTQ's Q with gptq_moment), "loftq": of deq(Q_t) + scaling *
    B @ A}."""
    if iters < 1:
        raise ValueError(f"loftq_init: iters must be >= 1, got {iters}")
    n, k = base.out_features, base.in_features
    if tuple(w.shape) != (n, k):
        raise ValueError(f"loftq_init: dense weight of shape {tuple(w.shape)} given for a ({n}, {k}) layer")
    full_rank = int(rank)
    rank = min(full_rank, n, k)
    w = w.to(device=base.weight.device, dtype=torch.float32)

    def deq_of(slots):
        return base.fmt.dequantize({name[len("weight") :]: v for name, v in slots.items()}, n, k, torch.float32)

    root, inv_root = (None, None) if metric is None else (metric[0].to(w.device), metric[1].to(w.device))
    res, best, plain = w, None, None
    for t in range(iters):
        slots = base.quantize_weight(res) if gptq_moment is None else gptq_quantize(base, res, gptq_moment.to(w.device))
        deq = deq_of(slots)
        if plain is None:
            plain = _frob_error(w, deq, None, root)
        if root is None:
            left, right = _low_rank_factors(w - deq, rank)
        else:
            left, right = _low_rank_factors((w - deq).double() @ root, rank)
            right = (right.double() @ inv_root).float()
        b, a = left / math.sqrt(scaling), right / math.sqrt(scaling)
        lr = scaling * (b @ a)
        err = _frob_error(w, deq, lr, root)
        if best is None or err < best[3]:
            best = (slots, a, b, err)
        res = w - lr
    slots, a, b, err = best
    if a.shape[0] < full_rank:  # r > min(out, in): the extra adapter rows and columns stay zero
        a = torch.cat([a, a.new_zeros(full_rank - a.shape[0], k)])
        b = torch.cat([b, b.new_zeros(n, full_rank - b.shape[1])], dim=1)
    return slots, a, b, {"plain": plain, "loftq": err}


def loftq_init(
    peft_model: nn.Module,
    weights=None,
    iters: int = 1,
    adapter_name: str = "default",
    calibration=None,
    damp: float = 0.01,
    calibration_memory: int = 4 << 30,
    quantizer: str = "round",
    gptq_damp: float = 0.3,
) -> dict[str, dict[str, float]]:
    """Initialise the LoRA adapters (and requantize the bases) of a PEFT model over surogate quantized
    linears so that deq(W_q) + scaling * B @ A approximates the dense weights (see the module doc).

    Args:
        peft_model: a PeftModel whose LoRA layers wrap surogate_hf quantized linears.
        weights: the dense weights: a checkpoint directory or .safetensors file, a state dict, or the dense
            model; None = the directory the base model was loaded from. Keys as in the base model's state dict.
        iters: alternating steps, 1 to 5 (1 = SVD of the plain quantization error; the base is unchanged).
        adapter_name: the adapter to initialise.
        calibration: None (LoftQ: fit the weight error), or batches of model inputs (input_ids tensors, or dicts
            of forward kwargs) from the training data: the fit then minimises each layer's output error over
            these inputs (activation-aware; see loftq_decompose). Each layer's input second moment is collected
            in fp32 by forward hooks on the quantized model.
        damp: the second moments' damping, relative to their mean diagonal (calibration only).
        calibration_memory: bytes of second moments held at once (in_features^2 * 4 per layer); layers beyond it
            are calibrated in further passes over the batches, after the earlier layers got their adapters.
        quantizer: how each base is (re)quantized: "round" (the format's round-to-nearest; with iters=1 the base
            is unchanged) or "gptq" (GPTQ codes on the format's own scales, minimising each layer's output error
            over the calibration inputs; needs calibration). Either way the base stays a plain tensor of its format.
        gptq_damp: GPTQ's damping of the second moments, relative to their mean diagonal. Larger than GPTQ's usual
            0.01 because a few calibration windows estimate H poorly: on the convergence benchmark's real model
            (mxfp4, 8 windows of 512 tokens) the step-0 loss was best at 0.3 of 0.01 / 0.1 / 0.3 / 1.0, with 8
            and with 32 windows (docs/fidelity.md).
    Returns {module name: {"plain": error, "loftq": error}}: relative Frobenius errors of each weight, or of each
    layer's output over the calibration inputs when calibration is given.
    """
    from peft.tuners.lora import LoraLayer

    from ..nn.linear import QuantizedLinear

    if not 1 <= int(iters) <= 5:
        raise ValueError(f"loftq_init: iters must be in 1..5, got {iters}")
    if not damp > 0:
        raise ValueError(f"loftq_init: damp must be > 0, got {damp}")
    if quantizer not in QUANTIZERS:
        raise ValueError(f"loftq_init: quantizer must be one of {QUANTIZERS}, got {quantizer!r}")
    if not gptq_damp > 0:
        raise ValueError(f"loftq_init: gptq_damp must be > 0, got {gptq_damp}")
    if quantizer == "gptq" and calibration is None:
        raise ValueError("loftq_init: quantizer='gptq' minimises each layer's output error over calibration inputs; "
                         "pass calibration= (batches of training inputs)")
    dense = _dense_weights(peft_model, weights)
    targets = []
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or adapter_name not in getattr(module, "lora_A", {}):
            continue
        base = module.get_base_layer()
        if not isinstance(base, QuantizedLinear):
            continue  # a dense base has no quantization error to compensate
        if getattr(module, "merged", False):
            raise ValueError(f"loftq_init: {name} has merged adapters; unmerge them first")
        key = (name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name) + ".weight"
        if key not in dense:
            raise KeyError(f"loftq_init: the dense weights have no tensor {key!r} for LoRA layer {name}")
        targets.append((name, module, base, key))
    if not targets:
        raise ValueError(f"loftq_init: no LoRA layer (adapter {adapter_name!r}) over a surogate_hf quantized linear found")
    batches = None if calibration is None else list(calibration)
    if batches is not None and not batches:
        raise ValueError("loftq_init: calibration holds no batch")
    report = {}
    for group in _groups(targets, None if batches is None else calibration_memory):
        moments = None if batches is None else _input_moments(peft_model, [t[2] for t in group], batches)
        for i, (name, module, base, key) in enumerate(group):
            metric = None if moments is None else input_metric(moments[i], damp)
            h = damped(moments[i], gptq_damp) if quantizer == "gptq" else None
            slots, a, b, errors = loftq_decompose(
                base, dense[key], module.r[adapter_name], float(module.scaling[adapter_name]), int(iters), metric, h
            )
            for slot, v in slots.items():
                S.set_slot(base, slot, v)
            base.slots_loaded()  # what the layer derives from its slots (the shared graph tables)
            la, lb = module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight
            la.data = a.to(device=la.device, dtype=la.dtype)
            lb.data = b.to(device=lb.device, dtype=lb.dtype)
            report[name] = errors
    return report


def _groups(targets: list, memory: int | None) -> list[list]:
    """The layers in module order, split so that each group's second moments fit in `memory` bytes (one group
    without calibration). A layer larger than the budget gets a group of its own."""
    if memory is None:
        return [targets]
    groups, size = [[]], 0
    for t in targets:
        need = t[2].in_features ** 2 * 4
        if groups[-1] and size + need > memory:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += need
    return groups


@torch.no_grad()
def _input_moments(model: nn.Module, bases: list, batches: list) -> list[Tensor]:
    """E[x x^T] (fp32, on each layer's device) of the inputs of `bases` over the calibration batches."""
    sums = [None] * len(bases)
    counts = [0] * len(bases)

    def hook(i):
        def fn(_mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[i] = x.t() @ x if sums[i] is None else sums[i].addmm_(x.t(), x)
            counts[i] += x.shape[0]

        return fn

    handles = [b.register_forward_pre_hook(hook(i)) for i, b in enumerate(bases)]
    device = next(p.device for p in model.parameters())
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            if isinstance(batch, Mapping):
                model(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()})
            elif isinstance(batch, Tensor):
                model(input_ids=batch.to(device))
            else:
                raise TypeError(f"loftq_init: calibration batches must be input_ids tensors or dicts of model inputs, "
                                f"got {type(batch).__name__}")
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    missing = [i for i, c in enumerate(counts) if c == 0]
    if missing:
        raise ValueError(f"loftq_init: {len(missing)} LoRA layer(s) saw no calibration input (the forward never "
                         "reached them)")
    return [sm / c for sm, c in zip(sums, counts)]
