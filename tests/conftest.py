"""Suite-wide fixtures."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_tf32_matmuls():
    """Each test starts with the TF32 setting of fp32 CUDA matmuls that the one before it started with. A Trainer that
    compiles without mixed precision turns TF32 on for every fp32 matmul of the process (accelerate's
    AcceleratorState sets `torch.backends.cuda.matmul.allow_tf32 = True`; transformers may set the new
    `fp32_precision` API instead) and never turns it off: a later test's fp32 reference GEMM then carries TF32's error
    (the few-token kernel's nvfp4 rows failed after the Trainer's torch_compile test).

    The snapshot reads the new API's string, which never raises. The legacy getters (`allow_tf32`,
    `torch.get_float32_matmul_precision`) raise once the two APIs were mixed (torch 2.11 on the GPU machine: 152 setup
    errors with the first version of this fixture, a teardown error with the second). The restore goes through the
    legacy setter, which writes both APIs' states, then puts the new API's value back."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    yield
    try:
        changed = matmul.fp32_precision != before or matmul.allow_tf32 != (before == "tf32")
    except RuntimeError:  # the two APIs disagree
        changed = True
    if changed:
        matmul.allow_tf32 = before == "tf32"
        matmul.fp32_precision = before
