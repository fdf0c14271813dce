"""Does SDPA get a built causal mask when the whole model is compiled? A 1-layer Llama traced by dynamo (CPU tensors,
no kernels run) with use_cache True / False and surogate_hf's compiled causal-mask skip off / on; prints whether each
SDPA call in the captured graph has no mask (is_causal instead). See surogate_hf/integrations/causal_mask.py and
results/compile_causal_mask_s37.md.

    python3 benchmarks/probe_compiled_mask.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from surogate_hf.integrations import causal_mask as CM


def sdpa_without_mask(use_cache: bool) -> list[bool]:
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = use_cache
    ids = torch.randint(0, 256, (2, 32))
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.kwargs.get("attn_mask") is None for n in gm.graph.nodes if "scaled_dot" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(input_ids=ids, labels=ids)
    return seen


def main():
    for use_cache in (True, False):
        for skip in (False, True):
            (CM.install_compiled_causal_mask_skip if skip else CM.uninstall_compiled_causal_mask_skip)()
            print(f"torch {torch.__version__} use_cache={use_cache} "
                  f"skip_installed={CM.is_compiled_causal_mask_skip_installed()}: "
                  f"SDPA without a mask: {sdpa_without_mask(use_cache)}")


if __name__ == "__main__":
    main()
