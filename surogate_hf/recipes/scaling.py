"""Delayed-scaling state of a whole model in flat tensors, updated once per optimizer step.

Transformer Engine's layout (scaleout.md): every FP8 role of every converted linear is one row of
the same buffers, so a training step costs ONE history roll + rescale per FP8 format and, under
torch.distributed, ONE all_reduce(MAX) of all amaxes, instead of a state update (and a collective)
per cast.

Rows: layer i of n owns row 2i (its input x, E4M3), row 2i+1 (its weight W, E4M3) and row 2n+i
(its output gradient dy, E5M2), so each format is one contiguous block.

Buffers:
  amax_history [R, H]  persistent, newest first (entry 0)
  x_row        [n]     persistent: the x row layer i casts with (2i, or a sibling's: recipes.norm)
  scale        [R]     persistent, the scale the next casts use
  amax         [R]     not persistent: the running max of |x| seen by the casts since the last update
                       (casts only ever raise it, so an activation-checkpoint recompute, which casts
                       the same tensor again, changes nothing). The dy rows are filled at the update
                       from each layer's own `fp8_dy_amax` [1] (fp8_hybrid.Fp8LinearFn says why).
  scale_inv    [R, 4]  not persistent: 1/scale, one 16-byte row per role because cuBLASLt refuses a
                       scale pointer that is not 16-byte aligned

The update (`update()`) runs after every optimizer step, whatever the optimizer (fused, foreach,
8-bit, the Trainer's default): torch.optim's global step post-hook calls it for each state whose
model the optimizer trains. It all-reduces `amax`, pushes it into the histories, recomputes the
scales (the surogate::delayed_scaling_update op, whose reference is the spec: a zero or non-finite
amax is recorded as 0 and keeps the previous scale) and clears `amax`. Between two updates every
cast of a role uses the same scale, so gradient-accumulation micro-batches and recomputes cast alike
and their amaxes are pushed as one entry (their max).

First step: until the first update (`initialized` false) a cast scales by the tensor's own amax
(current scaling, as TE's current scaling and torchao do), so the first step is as accurate as
dynamic scaling instead of flushing small activations and gradients to zero with scale 1.0.

`generation` counts updates process-wide; weight caches (the FP8 weight and its transpose, a bf16
work copy of fp32 masters) are keyed on it, so they are rebuilt once per optimizer step even when the
optimizer does not bump the parameters' version counters (torch._fused_adamw_ does not).
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist
from torch import nn

from .. import formats as F
from ..ops import recipe as _recipe_ops  # noqa: F401  (declares surogate::delayed_scaling_update)

_update_op = torch.ops.surogate.delayed_scaling_update

# ------------------------------------------------------------------ optimizer-step generation
_generation = itertools.count(1)
_current_generation = 0
_states: "weakref.WeakSet[Fp8ScalingState]" = weakref.WeakSet()
_hook_handle = None


def current_generation() -> int:
    """Number of recipe steps taken in this process (weight caches are valid within one)."""
    return _current_generation


def _bump_generation() -> None:
    global _current_generation
    _current_generation = next(_generation)


def _trains(optimizer, root: nn.Module, cache: "weakref.WeakKeyDictionary") -> bool:
    """Whether `optimizer` holds a parameter of `root` (computed once per optimizer and root)."""
    key = (len(optimizer.param_groups), sum(len(g["params"]) for g in optimizer.param_groups))
    hit = cache.get(optimizer)
    if hit is not None and hit[0] == key:
        return hit[1]
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    ok = any(id(p) in ids for p in root.parameters())
    cache[optimizer] = (key, ok)
    return ok


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    for state in list(_states):
        root = state.root()
        if root is not None and _trains(optimizer, root, state._optimizers):
            state.update()
    # every step of every optimizer moves the generation: a cache rebuilt once too often costs one cast per layer,
    # one kept too long trains on stale weights
    _bump_generation()


def install_step_hook() -> None:
    """Register the global optimizer step post-hook once (torch.optim public API). Every RecipeLinear does this
    on creation: its weight caches are keyed on the generation it moves."""
    global _hook_handle
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook_handle = register_optimizer_step_post_hook(_after_optimizer_step)


def recipe_step(model: nn.Module) -> None:
    """Run the per-step recipe update by hand (training loops that update weights without a torch.optim
    optimizer): push the amaxes of the casts since the last update and invalidate the weight caches."""
    for m in model.modules():
        if isinstance(m, Fp8ScalingState):
            m.update()
    _bump_generation()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Fp8ScalingState(nn.Module):
    """The delayed-scaling state of `n_layers` FP8 linears (rows described in the module docstring)."""

    def __init__(self, n_layers: int, history_len: int = 1024, algo: str = "max", margin: int = 0,
                 reduce_amax: bool = True, fwd_format: str = "e4m3", bwd_format: str = "e5m2", device=None):
        super().__init__()
        if algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo={algo!r} is unknown; choose 'max' or 'most_recent'")
        if n_layers < 1:
            raise ValueError(f"Fp8ScalingState needs at least one layer, got n_layers={n_layers}")
        self.n_layers = int(n_layers)
        self.fwd_format, self.bwd_format = F.fp8_dtype(fwd_format), F.fp8_dtype(bwd_format)
        self.algo, self.margin, self.reduce_amax = algo, int(margin), bool(reduce_amax)
        rows = 3 * self.n_layers
        self.register_buffer("amax_history", torch.zeros(rows, int(history_len), dtype=torch.float32, device=device))
        self.register_buffer("scale", torch.ones(rows, dtype=torch.float32, device=device))
        # layer i's x row: 2i, or the row of the sibling linears it shares its input with (recipes.norm: the linears
        # one FusedRMSNorm feeds cast with one row); persistent, so a reloaded or compiled model casts alike
        self.register_buffer("x_row", torch.arange(0, 2 * self.n_layers, 2, device=device))
        self.register_buffer("amax", torch.zeros(rows, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("scale_inv", torch.ones(rows, 4, dtype=torch.float32, device=device), persistent=False)
        self.initialized = False
        # plain references kept out of the module tree (__dict__, not _modules): the model whose optimizer steps
        # drive update(), and layer i's module (its fp8_dy_amax). Not weakrefs: copy.deepcopy of the model maps them
        # onto the copies through its memo, so a copied model's state follows the copy.
        self.__dict__["_root"] = None
        self.__dict__["_layer_list"] = [None] * self.n_layers
        self._optimizers = weakref.WeakKeyDictionary()
        self.register_load_state_dict_post_hook(lambda m, _keys: m._after_load())
        _states.add(self)
        install_step_hook()

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_optimizers", None)  # keyed by live optimizers: never copied or pickled
        return state

    def __setstate__(self, state):
        # copy.deepcopy / pickle rebuild the module without __init__: register the copy for step updates too
        super().__setstate__(state)
        self._optimizers = weakref.WeakKeyDictionary()
        _states.add(self)
        install_step_hook()

    def root(self) -> nn.Module | None:
        return self.__dict__["_root"]

    def attach(self, root: nn.Module) -> None:
        """The model (or layer) whose optimizer steps drive `update()`."""
        self.__dict__["_root"] = root

    def register_layer(self, index: int, layer: nn.Module) -> None:
        self.__dict__["_layer_list"][index] = layer

    def _gather_dy(self) -> None:
        layers = self.__dict__["_layer_list"]
        tail = self.amax[2 * self.n_layers :]
        if all(m is not None for m in layers):  # the model's layers: one cat, one max
            dy = [m.fp8_dy_amax for m in layers]
            torch.maximum(tail, torch.cat(dy), out=tail)
            torch._foreach_zero_(dy)
            return
        for i, m in enumerate(layers):  # a state used without (some of) its layers
            if m is not None:
                tail[i : i + 1] = torch.maximum(tail[i : i + 1], m.fp8_dy_amax)
                m.fp8_dy_amax.zero_()

    def rows(self, layer: int) -> tuple[int, int, int]:
        """(x, W, dy) rows of layer `layer`."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} out of range for {self.n_layers} layers")
        return int(self.x_row[layer]), 2 * layer + 1, 2 * self.n_layers + layer

    def share_x_row(self, layer: int, row: int) -> None:
        """Layer `layer` casts its input with row `row` from now on (another layer's x row: the same tensor)."""
        if row % 2 or not 0 <= row < 2 * self.n_layers:
            raise ValueError(f"share_x_row: {row} is not an x row of this state ({self.n_layers} layers)")
        self.x_row[layer] = row

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # checkpoints written before x_row existed: every layer on its own row
        state_dict.setdefault(prefix + "x_row", torch.arange(0, 2 * self.n_layers, 2))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"layers={self.n_layers}, history={self.amax_history.shape[1]}, algo={self.algo}, "
                f"margin={self.margin}, initialized={self.initialized}")

    def _after_load(self) -> None:
        # a checkpoint taken after at least one update has a non-empty history
        self.initialized = bool((self.amax_history != 0).any())
        for i, layer in enumerate(self.__dict__["_layer_list"]):
            if layer is not None and layer.fp8_rows[0] != int(self.x_row[i]):
                layer._share_input_row(int(self.x_row[i]))
        with torch.no_grad():
            self.scale_inv.copy_(self.scale.reciprocal().unsqueeze(1).expand_as(self.scale_inv))

    @torch.no_grad()
    def update(self) -> None:
        """Push the amaxes of the casts since the last update and recompute every scale (one op per format)."""
        self._gather_dy()
        amax = self.amax
        if self.reduce_amax and _distributed():
            # sanitized first so one rank's NaN cannot poison the others (the update sanitizes again)
            amax = torch.nan_to_num(amax, nan=0.0, posinf=0.0, neginf=0.0)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        split = 2 * self.n_layers
        use_max = self.algo == "max"
        _update_op(self.amax_history[:split], self.scale[:split], amax[:split].contiguous(), self.fwd_format,
                   self.margin, use_max)
        _update_op(self.amax_history[split:], self.scale[split:], amax[split:].contiguous(), self.bwd_format,
                   self.margin, use_max)
        self.scale_inv.copy_(self.scale.reciprocal().unsqueeze(1).expand_as(self.scale_inv))
        self.amax.zero_()
        self.initialized = True
