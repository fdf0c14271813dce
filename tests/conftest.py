"""Suite-wide fixtures."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_tf32_matmuls():
    """Each test starts with the TF32 setting of fp32 CUDA matmuls that the one before it started with. A Trainer that
    compiles without mixed precision turns TF32 on for every fp32 matmul of the process (accelerate's
    AcceleratorState sets `torch.backends.cuda.matmul.allow_tf32 = True`; transformers' TrainingArguments may set the
    new API's root, `torch.backends.fp32_precision = "tf32"`, which every "none" below it inherits) and never turns it
    off: a later test's fp32 reference GEMM then carries TF32's error
    (the few-token kernel's nvfp4 rows failed after the Trainer's torch_compile test).

    The snapshot reads the new API's string, which never raises. The legacy getters (`allow_tf32`,
    `torch.get_float32_matmul_precision`) raise once the two APIs were mixed (torch 2.11 on the GPU machine: 152 setup
    errors with the first version of this fixture, a teardown error with the second). The restore goes through the
    legacy setter, which writes both APIs' states, then puts the new API's values back, root first. (The second
    version restored only the CUDA matmul's own value: after the Trainer test its "none" still inherited TF32 from the
    root, and the few-token nvfp4 rows failed again on the GPU.)"""
    backends, matmul = torch.backends, torch.backends.cuda.matmul
    generic = getattr(backends, "fp32_precision", None)  # the new API's root, which "none" below inherits from
    before = matmul.fp32_precision
    yield
    try:
        changed = (getattr(backends, "fp32_precision", None) != generic or matmul.fp32_precision != before
                   or matmul.allow_tf32 != (before == "tf32"))
    except RuntimeError:  # the two APIs disagree
        changed = True
    if changed:
        if generic is not None:
            backends.fp32_precision = generic
        matmul.allow_tf32 = before == "tf32"
        matmul.fp32_precision = before
