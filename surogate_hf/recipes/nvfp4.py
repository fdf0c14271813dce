"""NVFP4 GEMMs of the nvfp4 recipe (emulated exactly where no native FP4 GEMM exists).

forward  y  = x W^T   : x in 1x16 blocks (RNE), W in 1x16 blocks along K (RNE)
dgrad    dx = dy W    : dy in 1x16 blocks (stochastic rounding), W in 1x16 blocks along N (RNE)
                        With fp4_weight_blocks="2d" (NVIDIA's pretraining recipe) W is quantized once in 16x16
                        tiles and the dgrad multiplies the same values transposed.
wgrad    dW = dy^T x  : reduction over tokens; both operands get the random Hadamard transform along
                        tokens (cancels exactly in the product), then 1x16 blocks, dy^T with
                        stochastic rounding, x^T with RNE. The token count is zero-padded to a multiple
                        of 16 (zeros add nothing to the product).
Four-Over-Six per the recipe config.

Each operand takes one amax pass and one quantize pass (surogate::nvfp4_amax / nvfp4_qdq, formats.nvfp4.qdq_nvfp4)
that writes the values the FP4 GEMM operand holds, e2m1 * s_blk, as bf16: exact (at most 5 significant bits). The
wgrad operands are quantized along the token axis in place of a transposed copy, the transform and the padding done
in the same pass. The GEMM is then a bf16 tensor-core GEMM with fp32 output, scaled by the product of the two
globals and rounded once (`gemm`): the NVFP4 GEMM up to fp32 summation order. The weight operands are
quantized once per optimizer step and cached as bf16: along K for the forward and along N for the dgrad (4 bytes per
parameter; finer scales than 16x16 tiles at the price of W and W^T no longer holding the same values), or with
fp4_weight_blocks="2d" one 16x16-tile copy whose transposed view serves the dgrad (2 bytes per parameter).

Stochastic rounding is replayable: the seed of each draw is a hash of (config seed, the layer's
index, the layer's step counter, the role); the step counter is a persistent buffer, so a resumed
run draws the same numbers as the uninterrupted one.

Native path: on SM100+ (kernels.probe.fp4_ok) the operands stay packed (`packed`: surogate::quantize_nvfp4 of the
same operand tensors, so the same values) and surogate::nvfp4_mm runs cuBLASLt's block-scaled FP4 GEMM
(kernels.fp4_native). No GPU we can reach has FP4 tensor cores: that path is written and its plumbing checked on
CPU against the bf16 one, but it has never run on a GPU. Everywhere else a one-time warning says the recipe is
emulated.
"""

from __future__ import annotations

import torch

from .. import formats as F
from ..ops import quant as _quant_ops  # noqa: F401  (registers quantize_nvfp4, nvfp4_qdq, rht)
from ..ops import recipe as _recipe_ops  # noqa: F401  (registers nvfp4_mm, nvfp4_qdq_mm)
from ..ops.recipe import below_autograd

ROLE_DGRAD, ROLE_WGRAD = 0, 1


def sr_seed(base_seed: int, index: int, step: int, role: int) -> int:
    """32-bit seed for one stochastic-rounding draw (counter-based hash, formats.rng)."""
    return F.rng.hash32_int(F.rng.hash32_int(base_seed, index), step * 2 + role)


def _cuda_eager(t: torch.Tensor) -> bool:
    return t.is_cuda and not torch.compiler.is_compiling()


def _split_seed(seed):
    """(int seed, seed tensor or None): a seed given as a tensor (traced) goes to the ops' seed_tensor."""
    if isinstance(seed, torch.Tensor):
        return 0, seed.reshape(1)
    return seed, None


def qdq(t: torch.Tensor, axis: int, fos: bool, rule: str, stochastic: bool = False, seed=0, signs=None):
    """(e2m1 * s_blk in bf16, decode global) of t's NVFP4 operand (formats.nvfp4.qdq_nvfp4): axis 1, 1x16 blocks along
    rows; axis 0, 16-blocks down the token axis (zero-padded); axis 2, 16x16 tiles. seed: an int, or one int64 tensor
    on t's device (traced: the kernel reads it). Eager on CUDA one call that takes the amax and quantizes
    (kernels.nvfp4_qdq, no Python op wrapper on the path); elsewhere the op."""
    seed, seed_t = _split_seed(seed)
    if _cuda_eager(t):
        return _kernels().qdq(t, None, signs, axis, fos, rule, stochastic, seed, seed_t)
    if t.is_cuda and _traced_ext():
        # a compiled graph on CUDA with the extension built: its C++ op, called with no Python in between (the op's
        # C++ makes the operand contiguous and aligned; shapes and the seed are checked here, at trace time)
        _kernels().check(t, signs, axis, stochastic)
        if seed_t is not None:
            from ..ops.quant import check_seed_tensor

            check_seed_tensor(seed_t, t)
        # without a transform the operand's amax is t's (the zero padding of axis 0 adds nothing): a torch reduction
        # that inductor fuses into the kernel producing t, in place of the extension's own pass over t (same bits)
        amax = t.detach().abs().amax().float() if signs is None and t.numel() else None
        return torch.ops.surogate.ext_nvfp4_qdq(t, amax, signs, axis, fos, F.nvfp4.FOUR_OVER_SIX_RULES.index(rule),
                                                stochastic, seed, seed_t)
    return torch.ops.surogate.nvfp4_qdq(t, None, signs, axis, fos, rule, stochastic, seed, seed_t)


def gemm(a: torch.Tensor, b: torch.Tensor, ga: torch.Tensor, gb: torch.Tensor, bias, out_dtype: torch.dtype):
    """cast((a @ b) * (ga * gb) + bias, out_dtype) for qdq operands a [M, K] and b [K, N] (any strides): the NVFP4
    GEMM up to fp32 summation order (formats.nvfp4.mm_qdq). On the GPU one bf16 tensor-core GEMM with fp32 output
    and one epilogue pass (Hopper has no FP4 tensor cores; the bf16 operands hold the FP4 values exactly)."""
    if _cuda_eager(a):
        return _kernels().gemm(a, b, ga, gb, bias, out_dtype)
    if a.is_cuda and _traced_ext():  # traced on CUDA with the extension: its C++ op (any strides)
        return torch.ops.surogate.ext_nvfp4_gemm(a, b, ga, gb, bias, out_dtype)
    return torch.ops.surogate.nvfp4_qdq_mm(a, b, ga, gb, bias, out_dtype)


@torch.compiler.assume_constant_result  # (whether the built library is loaded: a constant of the traced graph)
def _traced_ext() -> bool:
    from ..kernels import ext

    return ext.load(build=False) is not None


def _kernels():
    from ..kernels import nvfp4_qdq

    return nvfp4_qdq


@torch.compiler.assume_constant_result  # (a property of the device: a traced graph takes it as a constant)
def native_fp4(device: torch.device) -> bool:
    """FP4 tensor cores on `device` (kernels.probe.fp4_ok: SM100+): the operands then stay packed for
    surogate::nvfp4_mm's native GEMM. Never true on our machines (Hopper), so that path has not run on a GPU."""
    if device.type != "cuda":
        return False
    from ..kernels import probe

    return probe.fp4_ok(device.index or 0)[0]


def packed(t: torch.Tensor, axis: int, fos: bool, rule: str, stochastic: bool = False, seed=0, signs=None):
    """(packed E2M1 [rows, K/2], E4M3 block scales [rows, K/16], global) of t's NVFP4 operand as surogate::nvfp4_mm
    takes it, K being its GEMM's reduction dim: axis 1, t; axis 0, t^T with the tokens zero-padded to 16 (and
    transformed); axis 2, t in 16x16 tiles. The same values as qdq's (formats.nvfp4.nvfp4_operand)."""
    op = F.nvfp4_operand(t, axis, signs, transform=torch.ops.surogate.rht)
    seed, seed_t = _split_seed(seed)
    return torch.ops.surogate.quantize_nvfp4(op.contiguous(), axis == 2, fos, rule, stochastic, seed, None, seed_t)


def transpose_nvfp4_2d(packed_codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor):
    """W^T of a 16x16-tile NVFP4 tensor (layout only: codes and tile scales move, values do not change)."""
    codes = F.unpack_e2m1(packed_codes).t().contiguous()
    tiles = scale[:: F.NVFP4_BLOCK].t()  # [K/16, N/16]: one scale per 16x16 tile
    return F.pack_e2m1(codes), tiles.repeat_interleave(F.NVFP4_BLOCK, dim=0).contiguous(), global_scale


def sr_seeds_traced(base_seed: int, index: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[2] int64: sr_seed(base_seed, index, step, role) for ROLE_DGRAD and ROLE_WGRAD as tensor ops on the step's
    device (formats.rng.hash32 of int64 tensors: the same values), so a compiled graph derives them from its step
    counter without a host read and one graph serves every layer (index is a tensor too)."""
    inner = F.rng.hash32(base_seed, index.reshape(1))
    roles = torch.tensor([ROLE_DGRAD, ROLE_WGRAD], dtype=torch.int64, device=step.device)
    return F.rng.hash32(inner, step.reshape(1) * 2 + roles)


def take_sr_step(module, buffer: str = "fp4_sr_step"):
    """The stochastic-rounding step of a training forward of `module`, its counter advanced: traced, the int64 buffer
    itself, read and advanced in the graph by one op (surogate::take_step, which also knows a checkpoint recompute;
    returns a tensor); eager, a Python mirror of the buffer (returns an int:
    the seeds are hashed on the host, no device read per step). The mirror re-reads the buffer only when something
    else wrote it (a compiled graph, load_state_dict): its version counter moved."""
    counter = getattr(module, buffer)
    if torch.compiler.is_compiling():
        return torch.ops.surogate.take_step(counter)
    d = module.__dict__
    if d.get("_sr_version") != (id(counter), counter._version):
        d["_sr_step"] = int(counter.item())
    step = d["_sr_step"]
    d["_sr_step"] = step + 1
    counter.fill_(step + 1)
    d["_sr_version"] = (id(counter), counter._version)
    return step


def _operand(spec, t, axis, stochastic=False, seed=0, signs=None):
    """An operand as the GEMM of this device takes it: packed for FP4 tensor cores, else bf16 e2m1 * s_blk."""
    fos, rule, _, _, native = spec
    return (packed if native else qdq)(t, axis, fos, rule, stochastic, seed, signs)


def weight_operand(spec, w, dgrad: bool):
    """The weight operand of the forward (dgrad=False) or of the dgrad. 1D blocks run along each GEMM's reduction dim:
    K for the forward, N for the dgrad (qdq: laid out as W; packed: as W^T, rows K). 16x16 tiles serve both: the
    dgrad multiplies the transposed view (qdq) or the transposed codes (packed)."""
    _, _, _, weight_1d, native = spec
    if weight_1d:
        return _operand(spec, w, 0 if dgrad else 1)
    tiles = _operand(spec, w, 2)
    return transpose_nvfp4_2d(*tiles) if native and dgrad else tiles


def weight_operands(spec, w, need_dgrad: bool, need_fwd: bool = True) -> tuple:
    """(forward operand..., dgrad operand...) as one flat tuple of tensors; the dgrad's is the forward's where the same
    values serve (16x16 tiles on the bf16 path) or where no dgrad runs. need_fwd=False (the forward runs in
    model_dtype, recipes.switch): (dgrad operand...) alone, or () with no dgrad either."""
    _, _, _, weight_1d, native = spec
    separate = weight_1d or native
    if not need_fwd:
        return weight_operand(spec, w, separate) if need_dgrad else ()
    fwd = weight_operand(spec, w, False)
    return (*fwd, *(weight_operand(spec, w, True) if need_dgrad and separate else fwd))


def _mm(spec, a, b, bias, out_dtype, b_is_nk: bool):
    """a [M, K] x b as the operands hold them: native, both packed with rows M and N (K the packed dim); bf16 path,
    a [M, K] and b [N, K] (b_is_nk) or [K, N]."""
    if spec[4]:
        return torch.ops.surogate.nvfp4_mm(*a, *b, bias, out_dtype)
    return gemm(a[0], b[0].t() if b_is_nk else b[0], a[1], b[1], bias, out_dtype)


class Nvfp4LinearFn(torch.autograd.Function):
    """y = x W^T + b in the nvfp4 recipe's GEMMs, with only tensors and constants crossing it so dynamo traces it
    whole. w_ops: the weight operands (weight_operands), built once per optimizer step by the caller, or None: made
    here (traced). seeds: the (dgrad, wgrad) stochastic-rounding seeds as ints, or an int64 [2] tensor (traced).
    spec: (four_over_six, rule, stochastic rounding, 1x16 weight blocks, native FP4 operands). high_forward: the
    forward GEMM runs in x's dtype on the (work) weight, the dgrad and wgrad in FP4 (recipes.switch); w_ops then
    holds the dgrad operand alone (weight_operands(need_fwd=False))."""

    @staticmethod
    def forward(ctx, x, weight, bias, work, w_ops, signs, seeds, spec, high_forward=False):
        w = weight if work is None else work
        x2d = x.reshape(-1, x.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[:2]
        with below_autograd():
            if w_ops is None:
                w_ops = weight_operands(spec, w, need_dx, need_fwd=not high_forward)
            if high_forward:
                y = torch.nn.functional.linear(x2d, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
                dgrad_ops = w_ops
            else:
                half = len(w_ops) // 2
                y = _mm(spec, _operand(spec, x2d, 1), w_ops[:half], bias, x.dtype, True)
                dgrad_ops = w_ops[half:]
        traced = isinstance(seeds, torch.Tensor)
        ctx.save_for_backward(x2d if need_dw else None, signs if need_dw else None, seeds if traced else None,
                              *(dgrad_ops if need_dx else ()))
        ctx.int_seeds = None if traced else seeds
        ctx.spec, ctx.x_shape, ctx.w_dtype = spec, x.shape, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2d, signs, seeds_t, *wd = ctx.saved_tensors
        spec = ctx.spec
        seeds = ctx.int_seeds if seeds_t is None else seeds_t
        sr = spec[2]
        dy2d = dy.reshape(-1, dy.shape[-1])
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = dw = db = None
        with below_autograd():
            if need_dx:
                dyq = _operand(spec, dy2d, 1, sr, seeds[0] if sr else 0)
                # the dgrad operand: packed W^T rows K (native), else laid out as W [N, K]: dy [M, N] @ W
                dx = _mm(spec, dyq, wd, None, dy.dtype, spec[4]).reshape(ctx.x_shape)
            if need_dw:
                # the reduction runs over tokens: blocks along axis 0 (zero-padded to 16), the transform on both
                aq = _operand(spec, dy2d, 0, sr, seeds[1] if sr else 0, signs)
                bq = _operand(spec, x2d, 0, signs=signs)
                if spec[4]:
                    dw = torch.ops.surogate.nvfp4_mm(*aq, *bq, None, torch.float32)
                else:
                    dw = gemm(aq[0].t(), bq[0], aq[1], bq[1], None, torch.float32)
                dw = dw.to(ctx.w_dtype)
        if need_db:
            db = dy2d.float().sum(0).to(ctx.b_dtype)
        return dx, dw, db, None, None, None, None, None, None


class NVFP4Engine:
    """The nvfp4 recipe of one RecipeLinear: its spec, and in eager mode the weight operands cached per optimizer
    step (reused by micro-batches and recomputes)."""

    name = "nvfp4"

    def __init__(self, cfg):
        self.fos, self.rule = cfg.four_over_six, cfg.four_over_six_rule
        self.sr = not cfg.no_fp4_stochastic_rounding
        self.rht = cfg.fp4_rht
        self.weight_1d = cfg.fp4_weight_blocks == "1d"
        self.seed = cfg.seed

    def spec(self, device: torch.device) -> tuple:
        return (self.fos, self.rule, self.sr, self.weight_1d, native_fp4(device))

    def _quantize_weight(self, w, dgrad: bool, native: bool = False):
        return weight_operand((self.fos, self.rule, self.sr, self.weight_1d, native), w, dgrad)

    def weight_ops(self, owner, w, need_dgrad: bool, native: bool, need_fwd: bool = True) -> tuple:
        """weight_operands of `w` (need_fwd=False: the dgrad's alone), built once per optimizer step (the layer's
        weight key) in eager mode."""
        key = (owner._weight_key(), native)
        cached = getattr(owner, "_nvfp4_w", None)
        if cached is None or cached[0] != key:
            cached = owner._nvfp4_w = [key, None, None]
        separate = self.weight_1d or native
        if cached[1] is None and (need_fwd or (need_dgrad and not separate)):
            cached[1] = self._quantize_weight(w, False, native)
        if need_dgrad and separate and cached[2] is None:
            cached[2] = self._quantize_weight(w, True, native)
        dgrad = (cached[2] if separate else cached[1]) if need_dgrad else None
        if not need_fwd:
            return dgrad or ()
        return (*cached[1], *(dgrad or cached[1]))
