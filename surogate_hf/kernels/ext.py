"""The optional native extension (csrc/), JIT-built with torch.utils.cpp_extension and cached.

Nothing here runs at import of surogate_hf. `load(build=True)` (what `python -m
surogate_hf.kernels.build` calls) compiles it once per torch/CUDA version into the cache folder;
later processes only load the cached library. Kernels use it when `load(build=False)` finds it
built; otherwise they run the Triton version and warn once how to build it.
Environment: SUROGATE_HF_EXT=0 disables it; SUROGATE_HF_EXT_DIR overrides the cache folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

NAME = "surogate_hf_ext"
# the sources ship inside the package (surogate_hf/_csrc, a link to the repository's top-level csrc/ that the wheel
# build copies), so an installed wheel can build the extension as well as a checkout can
_CSRC = Path(__file__).resolve().parent.parent / "_csrc"
SOURCES = ("bindings.cpp", "fp8/cast_amax.cu", "fp8/block_gemm.cu", "fp8/scaled_mm.cpp", "fp8/fp8_linear.cpp",
           "fp4/nvfp4_qdq.cu", "fp4/few_token_gemm.cu", "weight_only/decode.cu", "weight_only/mixed_input_gemm.cu",
           "weight_only/decoded_linear.cpp", "norm/rmsnorm.cu", "norm/rmsnorm_op.cpp")


def arch_flags() -> list[str]:
    """nvcc's targets: those torch would pick for the visible GPUs, except that a compute capability 9.0 GPU gets
    sm_90a, the target with WGMMA (csrc/weight_only/mixed_input_gemm.cu compiles to an empty kernel elsewhere). A set
    TORCH_CUDA_ARCH_LIST is kept as it is ([]: torch applies it)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or not torch.cuda.is_available():
        return []
    # as torch does: no target above what its toolkit supports
    top = max(divmod(int(re.sub(r"\D", "", a[3:])), 10) for a in torch.cuda.get_arch_list() if a.startswith("sm_"))
    real = {tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())}
    caps = sorted({min(c, top) for c in real})
    # (sm_90a code runs on cc 9.0 only: not for a newer GPU clamped to 9.0, which gets the PTX)
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}"
             for a in (f"{ma}{mi}" + ("a" if (ma, mi) == (9, 0) and (9, 0) in real else "") for ma, mi in caps)]
    ma, mi = caps[-1]
    return flags + [f"-gencode=arch=compute_{ma}{mi},code=compute_{ma}{mi}"]  # PTX for newer GPUs, as torch adds


def sm90a_built() -> bool:
    """Whether the extension's SM90a kernels (the WGMMA mixed-input GEMM) are compiled in: by arch_flags on a cc 9.0
    GPU, or a TORCH_CUDA_ARCH_LIST naming 9.0a. (The kernel's launcher checks the loaded code itself as well.)"""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return "9.0a" in env.replace(" ", ";").split(";")
    return any("sm_90a" in f for f in arch_flags())

_module = None
_error: str | None = None


def build_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "surogate_hf"
    root = Path(os.environ.get("SUROGATE_HF_EXT_DIR", default))
    tag = f"torch{torch.__version__.split('+')[0]}-cu{(torch.version.cuda or 'none').replace('.', '')}"
    return root / f"{NAME}-{tag}"


def _built_library() -> Path:
    return build_dir() / f"{NAME}.so"


def loaded() -> bool:
    """Whether the extension is loaded in this process (an attribute read: callers on a hot path may ask per call)."""
    return _module is not None


def status() -> tuple[bool, str]:
    """(loaded, reason) without building anything."""
    if _module is not None:
        return True, ""
    if _error:
        return False, _error
    if os.environ.get("SUROGATE_HF_EXT", "1") == "0":
        return False, "disabled by SUROGATE_HF_EXT=0"
    if not _built_library().exists():
        return False, f"not built (run `python -m surogate_hf.kernels.build`; cache {build_dir()})"
    return True, "built, not loaded yet"


class ExtOps:
    """The extension's kernels by their C++ names (`fp8_block_gemm`, ...): the `surogate::ext_*` ops, whose CUDA
    kernels loading the library registered (their schemas, fakes and references: surogate_hf.ops.ext)."""

    def __init__(self):
        for name in OPS:
            setattr(self, name, getattr(torch.ops.surogate, f"ext_{name}"))


def load(build: bool = False):
    """The extension's ops (an ExtOps), or None. With build=False only an already built library is loaded."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    if os.environ.get("SUROGATE_HF_EXT", "1") == "0" or not torch.cuda.is_available():
        return None
    if not build and not _built_library().exists():
        return None
    missing = [s for s in SOURCES if not (_CSRC / s).exists()]
    if missing:
        _error = (f"csrc sources not found under {_CSRC} ({', '.join(missing)}): this installation lacks "
                  "surogate_hf/_csrc (the wheel ships it; reinstall the package)")
        return None
    from torch.utils.cpp_extension import load as _load

    from .. import ops  # noqa: F401  (declares the surogate::ext_* schemas the library registers CUDA kernels for)

    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    try:
        # a plain library (no pybind module): loading it registers the CUDA kernels of the surogate::ext_* ops
        _load(
            name=NAME,
            sources=[str(_CSRC / s) for s in SOURCES],
            build_directory=str(d),
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-std=c++17", *arch_flags()],  # no fast-math: the casts must round exactly,
            verbose=bool(os.environ.get("SUROGATE_HF_EXT_VERBOSE")),
            is_python_module=False,
        )
    except Exception as exc:  # a broken toolkit must not break the Triton path: report it
        _error = f"building/loading the extension failed: {type(exc).__name__}: {exc}"
        return None
    missing = [n for n in OPS if not torch._C._dispatch_has_kernel_for_dispatch_key(f"surogate::ext_{n}", "CUDA")]
    if missing:  # e.g. a library cached from sources that registered them under another name
        _error = (f"the loaded extension registers no CUDA kernel for surogate::ext_{missing[0]} (built from other "
                  f"sources?): delete {build_dir()} and run `python -m surogate_hf.kernels.build`")
        return None
    from ..ops.ext import sync_decode_registry

    sync_decode_registry()  # (layers loaded onto the GPU before the extension registered their operands here only)
    _module = ExtOps()
    return _module


OPS = ("fp8_cast_amax", "fp8_cast_transpose_amax", "fp8_quantize_tiles", "transpose_bytes", "fp8_block_gemm",
       "nvfp4_amax", "nvfp4_qdq", "nvfp4_gemm", "few_token_gemm", "mixed_input_gemm", "dequantize", "decoded_linear",
       "decoded_linear_fwd", "decoded_linear_bwd", "registered_linear_fwd", "registered_linear_bwd", "rmsnorm",
       "fp8_scaled_mm", "fp8_linear")
