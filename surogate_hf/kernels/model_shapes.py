"""Linear shapes of popular models (team notes, shapes.md): what the kernels are judged on.

Many of these dims are multiples of 32 or 64 but not of 128 or 256 (576, 192, 960, 320, 2880): the
path-decision test (tests/kernels/test_paths.py), the GPU kernel tests and benchmarks/bench_shapes.py walk them.
"""

from __future__ import annotations

# model: (hidden, q out, k/v out, mlp intermediate); GPT-OSS' intermediate is its experts' (32 experts)
MODELS: dict[str, tuple[int, int, int, int]] = {
    "SmolLM2-135M": (576, 576, 192, 1536),
    "SmolLM2-360M": (960, 960, 320, 2560),
    "Qwen2.5-0.5B": (896, 896, 128, 4864),
    "Qwen2.5-1.5B": (1536, 1536, 256, 8960),
    "Qwen3-0.6B": (1024, 2048, 1024, 3072),
    "Qwen3-1.7B": (2048, 2048, 1024, 6144),
    "Llama-3.2-1B": (2048, 2048, 512, 8192),
    "Gemma-3-1B": (1152, 1024, 256, 6912),
    "Gemma-2-2B": (2304, 2048, 1024, 9216),
    "Qwen2.5-7B": (3584, 3584, 512, 18944),
    "Llama-3.1-8B": (4096, 4096, 1024, 14336),
    "GPT-OSS-20B": (2880, 4096, 512, 2880),
}


def linears(model: str) -> dict[str, tuple[int, int]]:
    """{projection: (in_features, out_features)} of one decoder layer: q, k/v, o, gate/up, down."""
    hidden, q, kv, inter = MODELS[model]
    return {"q": (hidden, q), "kv": (hidden, kv), "o": (q, hidden), "gate_up": (hidden, inter), "down": (inter, hidden)}


def all_linears() -> list[tuple[str, str, int, int]]:
    """[(model, projection, in_features, out_features)] over the whole table."""
    return [(m, p, k, n) for m in MODELS for p, (k, n) in linears(m).items()]


def unique_linears() -> list[tuple[int, int]]:
    """Distinct (in_features, out_features) pairs of the table, in table order."""
    seen: dict[tuple[int, int], None] = {}
    for _, _, k, n in all_linears():
        seen.setdefault((k, n), None)
    return list(seen)
