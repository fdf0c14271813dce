"""Capability probes: each returns (ok, reason). Used by dispatch and by pytest skipif.

Cheap and side-effect free: they look for modules with importlib.util.find_spec and never import
triton or build the native extension.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def cuda_ok() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    return True, ""


@functools.cache
def triton_ok() -> tuple[bool, str]:
    ok, why = cuda_ok()
    if not ok:
        return ok, why
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install triton)"
    return True, ""


@functools.cache
def hopper_ok() -> tuple[bool, str]:
    """FP8 tensor cores (SM 8.9+) and block-scaled scaled_mm (torch.nn.functional.scaled_mm, SM 9.0)."""
    ok, why = cuda_ok()
    if not ok:
        return ok, why
    cap = torch.cuda.get_device_capability()
    if cap < (9, 0):
        return False, f"block-scaled FP8 GEMMs need compute capability >= 9.0, this GPU has {cap[0]}.{cap[1]}"
    if not hasattr(torch.nn.functional, "scaled_mm"):
        return False, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (needs torch >= 2.10)"
    return True, ""


@functools.cache
def fp8_ok() -> tuple[bool, str]:
    """FP8 tensor cores through torch._scaled_mm (SM 8.9+)."""
    ok, why = cuda_ok()
    if not ok:
        return ok, why
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        return False, f"FP8 GEMMs need compute capability >= 8.9, this GPU has {cap[0]}.{cap[1]}"
    return True, ""


@functools.cache
def fp4_ok(device_index: int = 0) -> tuple[bool, str]:
    """Native NVFP4 GEMMs (FP4 tensor cores, cuBLASLt block-scaled torch._scaled_mm): SM 10.0+ and a torch with the
    float4_e2m1fn_x2 dtype; SUROGATE_HF_NATIVE_FP4=0 turns them off. No GPU of ours has them (Hopper is SM 9.0):
    the code path is written against cuBLAS's documented layout and its CPU-checkable parts are tested, but it has
    never run."""
    if os.environ.get("SUROGATE_HF_NATIVE_FP4", "1") == "0":
        return False, "disabled by SUROGATE_HF_NATIVE_FP4=0"
    ok, why = cuda_ok()
    if not ok:
        return ok, why
    cap = torch.cuda.get_device_capability(device_index)
    if cap < (10, 0):
        return False, f"FP4 tensor cores need compute capability >= 10.0, this GPU has {cap[0]}.{cap[1]}"
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return False, f"torch {torch.__version__} has no float4_e2m1fn_x2 dtype"
    return True, ""


@functools.cache
def triton_kernels(module: str, what: str):
    """surogate_hf.kernels.<module> (Triton kernels), imported on first use after triton_ok(); `what` names the
    caller in the error when Triton cannot run."""
    ok, why = triton_ok()
    if not ok:
        raise RuntimeError(f"{what} need Triton: {why}")
    return importlib.import_module(f"{__package__}.{module}")


def extension_ok() -> tuple[bool, str]:
    """Whether the csrc extension is built and loaded (building it if a toolkit is there)."""
    ok, why = cuda_ok()
    if not ok:
        return ok, why
    from . import ext

    return ext.status()
