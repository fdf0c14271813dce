"""What a checkpoint's quantization_config says: which module is stored in which format.

Dense linears in an "mxfp4" checkpoint and experts in "mxfp4" / "bitsandbytes" ones are quantized only where the
stored tensors are packed (transformers' own readers quantize GPT-OSS experts / nn.Linear only); checkpoint.py
decides those from the safetensors headers.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch
from transformers.quantizers.quantizers_utils import should_convert_module

from ...formats.mxfp4 import MXFP4_BLOCK
from ...formats.nvfp4 import NVFP4_BLOCK

NVFP4_GROUP = NVFP4_BLOCK  # the formats' own block sizes, under the names ModelOpt's configs use
MXFP4_GROUP = MXFP4_BLOCK
MODELOPT_ALGOS = ("NVFP4", "FP8", "MIXED_PRECISION")


class PrequantizedCheckpointError(ValueError):
    """A pre-quantized checkpoint that cannot be loaded as stored; the message names every offending key."""


@dataclass(frozen=True)
class LayerFormat:
    """How one module is stored. kind: fp8_block | fp8_tensor | nvfp4 | mxfp4 | mxfp4_experts | nf4."""

    kind: str
    block: tuple[int, int] | None = None  # fp8_block
    ue8m0: bool = False  # fp8_block: power-of-two scales
    origin: str = ""  # the config entry that decided it, for messages
    nf4_block: int = 0  # nf4: blocksize and double quantization, read from the stored QuantState (checkpoint.py)
    double_quant: bool = False
    packed_only: bool = False  # quantized only where the stored weight is packed (see the module docstring)


@dataclass
class CheckpointScheme:
    method: str  # fp8 | modelopt | mxfp4 | bitsandbytes
    raw: dict  # the quantization_config as stored (config.json form), written back on save
    source: str  # where it was read, for messages
    skip: list[str] = field(default_factory=list)
    skip_is_glob: bool = False
    algo: str | None = None  # modelopt quant_algo
    per_layer: dict[str, str] = field(default_factory=dict)  # MIXED_PRECISION: module name -> algo
    fp8_block: tuple[int, int] | None = None
    ue8m0: bool = False
    lenient_dense: bool = False  # bitsandbytes without llm_int8_skip_modules: dense-stored linears stay dense

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "CheckpointScheme":
        if "quantization" in d and isinstance(d["quantization"], dict):  # ModelOpt's hf_quant_config.json
            d = {"quant_method": "modelopt", **d["quantization"]}
        method = d.get("quant_method")
        if method == "fp8":
            return cls._fp8(d, source)
        if method == "modelopt":
            return cls._modelopt(d, source)
        if method == "mxfp4":
            return cls(method="mxfp4", raw=dict(d), source=source, skip=list(d.get("modules_to_not_convert") or []))
        if method == "bitsandbytes":
            return cls._bitsandbytes(d, source)
        raise PrequantizedCheckpointError(
            f"{source}: quant_method {method!r} is not a pre-quantized layout surogate_hf loads; "
            "supported: 'fp8' (fine-grained), 'modelopt' (NVFP4, FP8, MIXED_PRECISION), 'mxfp4' (GPT-OSS experts, "
            "dense linears), 'bitsandbytes' (4-bit NF4)"
        )

    @classmethod
    def _bitsandbytes(cls, d: dict, source: str) -> "CheckpointScheme":
        if d.get("load_in_8bit") or not d.get("load_in_4bit"):
            raise PrequantizedCheckpointError(
                f"{source}: bitsandbytes load_in_8bit (LLM.int8) is not supported by surogate_hf; it loads 4-bit NF4 "
                "(load_in_4bit=True, bnb_4bit_quant_type='nf4')"
            )
        qtype = d.get("bnb_4bit_quant_type", "fp4")  # bitsandbytes' own default
        if qtype != "nf4":
            raise PrequantizedCheckpointError(
                f"{source}: bnb_4bit_quant_type {qtype!r} is not supported by surogate_hf; it loads 'nf4'"
            )
        storage = d.get("bnb_4bit_quant_storage") or "uint8"
        if storage != "uint8":
            raise PrequantizedCheckpointError(
                f"{source}: bnb_4bit_quant_storage {storage!r} is not supported by surogate_hf; it loads uint8 packing"
            )
        skip = d.get("llm_int8_skip_modules")
        # Without an explicit skip list transformers adds its own defaults (lm_head, ...) at load time: then a
        # linear stored dense is read as dense instead of being an error.
        return cls(method="bitsandbytes", raw=dict(d), source=source, skip=list(skip or []),
                   lenient_dense=skip is None)

    @classmethod
    def _fp8(cls, d: dict, source: str) -> "CheckpointScheme":
        block = d.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or any(int(b) <= 0 for b in block):
                raise PrequantizedCheckpointError(f"{source}: weight_block_size must be two positive ints, got {block!r}")
            block = (int(block[0]), int(block[1]))
        scale_fmt = d.get("scale_fmt") or "float"
        if scale_fmt not in ("float", "ue8m0"):
            raise PrequantizedCheckpointError(f"{source}: scale_fmt {scale_fmt!r} unknown; expected 'float' or 'ue8m0'")
        if d.get("modules_to_convert"):
            raise PrequantizedCheckpointError(
                f"{source}: modules_to_convert (FP8 embeddings) is not supported by surogate_hf's pre-quantized loader"
            )
        if (d.get("expert_dtype") or "fp8") != "fp8":
            raise PrequantizedCheckpointError(
                f"{source}: expert_dtype {d['expert_dtype']!r} (FP4 experts inside an fp8 checkpoint) is not supported"
            )
        return cls(
            method="fp8",
            raw=dict(d),
            source=source,
            skip=list(d.get("modules_to_not_convert") or []),
            fp8_block=block,
            ue8m0=scale_fmt == "ue8m0",
        )

    @classmethod
    def _modelopt(cls, d: dict, source: str) -> "CheckpointScheme":
        algo = d.get("quant_algo")
        if algo not in MODELOPT_ALGOS:
            raise PrequantizedCheckpointError(
                f"{source}: unknown ModelOpt quant_algo {algo!r}; surogate_hf loads {', '.join(MODELOPT_ALGOS)}"
            )
        per_layer = {}
        if algo == "MIXED_PRECISION":
            layers = d.get("quantized_layers")
            if not isinstance(layers, dict) or not layers:
                raise PrequantizedCheckpointError(f"{source}: quant_algo MIXED_PRECISION needs a non-empty quantized_layers")
            for name, entry in layers.items():
                sub = (entry or {}).get("quant_algo")
                if sub not in ("NVFP4", "FP8"):
                    raise PrequantizedCheckpointError(
                        f"{source}: quantized_layers[{name!r}] has unknown quant_algo {sub!r}; expected NVFP4 or FP8"
                    )
                _check_group(entry, f"{source}: quantized_layers[{name!r}]", sub)
                per_layer[name] = sub
        else:
            _check_group(d, source, algo)
        skip = list(d.get("exclude_modules") or []) + list(d.get("ignore") or [])
        return cls(method="modelopt", raw=_modelopt_config_json(d), source=source, skip=skip, skip_is_glob=True,
                   algo=algo, per_layer=per_layer)

    def is_skipped(self, name: str) -> bool:
        if not self.skip:
            return False
        if self.skip_is_glob:  # ModelOpt writes fnmatch-style globs ("model.layers.*.mlp.gate", "*lm_head*")
            return any(re.fullmatch(re.escape(p).replace(r"\*", ".*"), name) for p in self.skip) or any(
                name == p or name.startswith(p + ".") or name.endswith("." + p) for p in self.skip
            )
        return not should_convert_module(name, self.skip)

    def layer_format(self, name: str, module) -> LayerFormat | None:
        """The stored format of module `name`, None when it is stored dense."""
        if self.method == "mxfp4" and _is_gpt_oss_experts(module):
            if not self.is_skipped(name):
                return LayerFormat("mxfp4_experts", origin=f"{self.source} (quant_method mxfp4)")
            return None
        if not isinstance(module, torch.nn.Linear):
            return None
        return self.linear_format(name)

    def linear_format(self, name: str) -> LayerFormat | None:
        """Format of the linear projection `name` (a module, or one expert's component like `experts.3.up_proj`)."""
        if self.is_skipped(name):
            return None
        if self.method == "mxfp4":
            return LayerFormat("mxfp4", origin=f"{self.source} (quant_method mxfp4)", packed_only=True)
        if self.method == "bitsandbytes":
            return LayerFormat("nf4", origin=f"{self.source} (quant_method bitsandbytes, nf4)",
                               packed_only=self.lenient_dense)
        if self.method == "fp8":
            return LayerFormat("fp8_block", block=self.fp8_block, ue8m0=self.ue8m0, origin=f"{self.source} (quant_method fp8)")
        algo = self.per_layer.get(name) if self.algo == "MIXED_PRECISION" else self.algo
        if algo is None:
            return None
        origin = f"{self.source} (ModelOpt {'quantized_layers[' + repr(name) + '] ' if self.per_layer else ''}quant_algo {algo})"
        return LayerFormat("nvfp4" if algo == "NVFP4" else "fp8_tensor", origin=origin)


def _check_group(d: dict, where: str, algo: str) -> None:
    if algo == "NVFP4" and d.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
        raise PrequantizedCheckpointError(f"{where}: NVFP4 group_size {d.get('group_size')!r} unsupported; expected 16")


def _modelopt_config_json(d: dict) -> dict:
    """The config.json form of a ModelOpt quantization config (flat, quant_method 'modelopt')."""
    out = {"quant_method": "modelopt"}
    out.update({k: v for k, v in d.items() if k not in ("quant_method", "producer")})
    return out


def _is_gpt_oss_experts(module) -> bool:
    return type(module).__name__ == "GptOssExperts" or getattr(module, "quant_format", None) == "mxfp4_experts"


def _read_json(checkpoint_dir: str, name: str) -> dict | None:
    path = os.path.join(checkpoint_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_legacy_modelopt_config(checkpoint_dir: str) -> dict | None:
    """ModelOpt's older exports keep the quantization config in hf_quant_config.json next to the weights."""
    d = _read_json(checkpoint_dir, "hf_quant_config.json")
    if d is not None and not isinstance(d.get("quantization"), dict):
        raise PrequantizedCheckpointError(
            f"{os.path.join(checkpoint_dir, 'hf_quant_config.json')}: expected a 'quantization' object "
            "(ModelOpt hf_quant_config.json)"
        )
    return d


def read_config_json_quantization(checkpoint_dir: str) -> dict | None:
    """The quantization_config dict of the checkpoint's config.json (top level or text_config), None when absent."""
    cfg = _read_json(checkpoint_dir, "config.json") or {}
    for d in (cfg, cfg.get("text_config") or {}):
        if isinstance(d.get("quantization_config"), dict):
            return d["quantization_config"]
    return None


