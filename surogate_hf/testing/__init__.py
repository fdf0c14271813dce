"""Builders and fixtures shared by the test suite (tests/), importable without pytest.

    models       tiny Llama / Qwen3 / Qwen3-MoE / GPT-OSS models from configs, save_tiny_model, sqnr_db, sample ids
    prequant     tiny pre-quantized checkpoints in the layouts real exports use (fine-grained FP8, ModelOpt,
                 GPT-OSS MXFP4, bitsandbytes NF4), written on CPU
    recipes      tiny models and token data for the recipe tests
    dist_worker  one rank of the multi-process checks: `python -m torch.distributed.run ... -m
                 surogate_hf.testing.dist_worker OUT_DIR CASE_DIR...` (tests/test_distributed.py)

Not imported by surogate_hf itself; the top import floor (tools/check_layers.py), so it may use any part of the
package. Import the submodules: `from surogate_hf.testing.models import save_tiny_model`.
"""
