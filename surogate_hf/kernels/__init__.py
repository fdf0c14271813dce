"""GPU implementations of the surogate:: ops: Triton kernels, cuBLASLt FP8 GEMMs and an optional
CUDA C++ extension (csrc/), registered under the reference ops' names for the CUDA backend.

Importing this package registers thin wrappers only: Triton modules are imported, and the native
extension loaded, on the first CUDA call. Probes return (ok, reason) for dispatch and test skips.
"""

from .probe import cuda_ok, extension_ok, fp8_ok, hopper_ok, triton_ok
from .registry import register, registered_ops

register()

__all__ = ["cuda_ok", "extension_ok", "fp8_ok", "hopper_ok", "triton_ok", "register", "registered_ops"]
