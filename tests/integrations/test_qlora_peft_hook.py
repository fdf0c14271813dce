"""The one PEFT hook (surogate_hf.integrations.peft.install_peft_dispatch): pins what it relies on in PEFT, so an
upstream change fails here first, and shows what it changes (quantized bases only) and what it leaves alone."""

import inspect

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import layer as lora_layer
from peft.tuners.lora.model import LoraModel
from torch import nn

from surogate_hf.integrations.peft import (
    SurogateLoraLinear,
    install_peft_dispatch,
    is_peft_dispatch_installed,
    uninstall_peft_dispatch,
)
from surogate_hf.nn import NVFP4Linear


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q = NVFP4Linear.from_linear(nn.Linear(64, 32))
        self.dense = nn.Linear(32, 32)

    def forward(self, x):
        return self.dense(self.q(x))


@pytest.fixture
def restore_hook():
    was = is_peft_dispatch_installed()
    yield
    (install_peft_dispatch if was else uninstall_peft_dispatch)()


def test_upstream_contract_the_hook_relies_on():
    # LoraModel picks the LoRA class in a static `_create_new_module(lora_config, adapter_name, target, **kwargs)`
    raw = inspect.getattr_static(LoraModel, "_create_new_module")
    assert isinstance(raw, staticmethod)
    fn = getattr(raw.__func__, "__surogate_original__", raw.__func__)
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params[:3]] == ["lora_config", "adapter_name", "target"]
    assert params[3].kind is inspect.Parameter.VAR_KEYWORD
    # ... is called by _create_and_replace with these keywords
    src = inspect.getsource(LoraModel._create_and_replace)
    assert "self._create_new_module(lora_config, adapter_name, target, device_map=device_map, **kwargs)" in src
    # merge_and_unload asks a layer for its replacement through this method name
    from peft.tuners import tuners_utils

    assert 'hasattr(target, "unload_and_optionally_merge_module")' in inspect.getsource(
        tuners_utils.BaseTuner._unload_and_optionally_merge
    )
    # and LoraModel._replace_module does not copy `weight` from the old module into the new one
    assert "new_module.weight = child.weight" not in inspect.getsource(LoraModel._replace_module)
    # the per-config registry is not persisted: the reason a hook is needed at all
    assert "_custom_modules" not in LoraConfig(r=4).to_dict()


def test_hook_claims_quantized_bases_only_and_is_idempotent(restore_hook):
    uninstall_peft_dispatch()
    stock = get_peft_model(Toy(), LoraConfig(r=4, target_modules=["q", "dense"]))
    assert type(stock.base_model.model.q) is lora_layer.Linear  # without the hook: PEFT's plain layer

    install_peft_dispatch()
    first = LoraModel.__dict__["_create_new_module"]
    install_peft_dispatch()
    assert LoraModel.__dict__["_create_new_module"] is first  # installing twice wraps once

    model = get_peft_model(Toy(), LoraConfig(r=4, target_modules=["q", "dense"]))
    assert isinstance(model.base_model.model.q, SurogateLoraLinear)
    assert type(model.base_model.model.dense) is lora_layer.Linear  # dense layers: PEFT's choice, untouched
    x = torch.randn(3, 64)
    model(x).sum().backward()
    assert model.base_model.model.q.lora_A["default"].weight.grad is not None

    uninstall_peft_dispatch()
    assert not is_peft_dispatch_installed()
    assert LoraModel.__dict__["_create_new_module"].__func__ is first.__func__.__surogate_original__


def test_target_parameters_on_quantized_modules_is_refused(restore_hook):
    install_peft_dispatch()
    # the packed weight is a buffer (PEFT cannot even find it); a frozen Parameter of the module is refused by us
    # instead of PEFT's ParamWrapper parametrizing it as if it were a dense weight
    with pytest.raises(ValueError, match="points into a quantized nvfp4 NVFP4Linear"):
        get_peft_model(Toy(), LoraConfig(r=4, target_modules=None, target_parameters=["q.bias"]))


@pytest.mark.parametrize("prequantized", [False, True], ids=["online", "prequantized"])
def test_loading_a_quantized_model_installs_the_hook(tmp_path, restore_hook, prequantized):
    """model.load_adapter / PeftModel.from_pretrained right after from_pretrained (no prepare_for_training) must
    still build SurogateLoraLinear: the quantizers call install_peft_dispatch() when they load a model."""
    from transformers import AutoModelForCausalLM

    from surogate_hf import SurogateConfig
    from surogate_hf.data import build_tiny_model, tiny_llama_config

    build_tiny_model(tiny_llama_config(32, num_layers=1), seed=0).save_pretrained(tmp_path / "dense")
    path, qc = tmp_path / "dense", SurogateConfig(format="fp8")
    if prequantized:
        AutoModelForCausalLM.from_pretrained(path, quantization_config=qc).save_pretrained(tmp_path / "fp8")
        path, qc = tmp_path / "fp8", SurogateConfig()
    uninstall_peft_dispatch()
    AutoModelForCausalLM.from_pretrained(path, quantization_config=qc)
    assert is_peft_dispatch_installed()
