"""Importing surogate_hf (every module of it) changes no object of transformers, peft, accelerate or torch.

Registering through public registries (transformers' quantizer mappings, torch.library) is allowed: those are dicts
that gain entries, the objects checked here keep their identity. The two library patches have explicit entry points
(the merge seam: creating a SurogateConfig; the PEFT dispatch: prepare_for_training and our quantizers loading a
model), each with its own drift test (test_prequantized.py::test_merge_patch_still_needed,
test_qlora_peft_hook.py::test_upstream_contract_the_hook_relies_on).
"""

import subprocess
import sys

CODE = r"""
import importlib, inspect, pkgutil
import torch, transformers, peft, accelerate
MODULES = [
    "transformers.quantizers.auto", "transformers.quantizers.base", "transformers.modeling_utils",
    "transformers.core_model_loading", "transformers.trainer", "transformers.trainer_callback",
    "transformers.utils.quantization_config", "peft.tuners.lora.model", "peft.tuners.lora.layer", "peft.peft_model",
    "peft.tuners.tuners_utils", "accelerate.accelerator", "torch.nn.modules.linear", "torch.nn.modules.module",
]
mods = [importlib.import_module(m) for m in MODULES]

def snapshot():
    snap = {}
    for m in mods:
        for k, v in list(vars(m).items()):
            snap[(m.__name__, k)] = v
            if inspect.isclass(v) and v.__module__ == m.__name__:
                for ck, cv in list(vars(v).items()):
                    snap[(m.__name__, k, ck)] = cv
    return snap

before = snapshot()
import surogate_hf
skipped = []
for info in pkgutil.walk_packages(surogate_hf.__path__, "surogate_hf."):
    if info.name.endswith(".__main__"):
        continue  # `python -m` entry scripts run their command when imported
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as e:  # GPU-only modules on a machine without triton
        if e.name != "triton":
            raise
        skipped.append(info.name)
for name in surogate_hf._LAZY:
    getattr(surogate_hf, name)
after = snapshot()
changed = sorted(".".join(k) for k, v in before.items() if after.get(k, before) is not v)
added = sorted(".".join(k) for k in after if k not in before and len(k) == 3)
assert not changed and not added, f"importing surogate_hf changed {changed} and added {added}"
# the same snapshot sees a patch: the merge seam, once a SurogateConfig is created (so the check above can fail)
surogate_hf.SurogateConfig()
patched = sorted(".".join(k) for k, v in before.items() if snapshot().get(k, before) is not v)
assert patched == ["transformers.quantizers.auto.AutoHfQuantizer.merge_quantization_configs"], patched
print("ok", len(before), "skipped (no triton):", skipped)
"""


def test_importing_every_module_changes_no_library_object_and_a_config_installs_only_the_merge_seam():
    res = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr[-3000:]
