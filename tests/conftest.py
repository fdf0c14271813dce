"""Suite-wide fixtures."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_tf32_matmuls():
    """Each test starts with the TF32 setting of fp32 matmuls that the one before it started with. accelerate turns
    TF32 on for every fp32 matmul of the process when a Trainer compiles without mixed precision (AcceleratorState: a
    dynamo backend, mixed_precision "no", a CUDA device; `torch.backends.cuda.matmul.allow_tf32 = True`) and never
    turns it off: a later test's fp32 reference GEMM then carries TF32's error (the few-token kernel's nvfp4 rows
    failed after the Trainer's torch_compile test). The flag accelerate sets is the one read and restored here
    (torch.get_float32_matmul_precision refuses to read a state set through it on some versions)."""
    matmul = torch.backends.cuda.matmul
    try:
        before = matmul.allow_tf32
    except RuntimeError:  # a state this torch refuses to read (legacy and new TF32 APIs mixed): leave it to the test
        before = None
    yield
    if before is not None and matmul.allow_tf32 != before:
        matmul.allow_tf32 = before
