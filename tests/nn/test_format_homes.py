"""One home per format (surogate_hf/nn/formats/): the registry, the options dataclasses, and that a format added
as one registered class works through the module swap, the options and the save codec (docs/adding_a_format.md)."""

import dataclasses

import pytest
import torch
from torch import nn

from surogate_hf import SurogateConfig
from surogate_hf.nn import linear as L
from surogate_hf.nn import replace_with_quantized_modules
from surogate_hf.nn.formats import (
    FORMAT_CLASSES,
    FORMATS,
    LAYOUTS,
    FP8Options,
    Format,
    NF4Options,
    NVFP4Options,
    Options,
    make_format,
    register,
)


def test_registry_lists_every_format_and_layout():
    assert FORMATS == ("fp8", "nvfp4", "mxfp4", "nf4")
    assert sorted(LAYOUTS) == sorted(["fp8_block", "fp8_tensor", "nvfp4", "mxfp4", "mxfp4_experts", "nf4"])
    for kind, layout in LAYOUTS.items():
        assert layout.kind == kind and layout.format in FORMAT_CLASSES
    for name, cls in FORMAT_CLASSES.items():
        fmt = make_format(name)
        assert fmt.name == name and isinstance(fmt.options, cls.options_class)
        assert L.linear_class(name) is L.LINEAR_CLASSES[name]


def test_options_are_validated_and_errors_name_the_option():
    with pytest.raises(ValueError, match="block_size must be two ints"):
        FP8Options(block_size=(128,))
    with pytest.raises(ValueError, match="ue8m0 must be True or False"):
        FP8Options(ue8m0=1)
    with pytest.raises(ValueError, match="four_over_six_rule must be one of"):
        NVFP4Options(four_over_six_rule="max")
    with pytest.raises(ValueError, match="unsupported block_size 32"):
        NF4Options(block_size=32)
    with pytest.raises(ValueError, match="unsupported block_size 32"):
        make_format("nf4", block_size=32)
    assert FP8Options(block_size="tensor").block_size is None
    assert FP8Options(block_size=[64, 128]).block_size == (64, 128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        NF4Options().block_size = 128


def test_config_fields_translate_to_the_home_options():
    # SurogateConfig spells NF4's options with a prefix; the home's CONFIG_FIELDS is the one translation
    assert SurogateConfig(format="nf4", nf4_block_size=128, nf4_double_quant=False).format_options() == {
        "block_size": 128, "double_quant": False, "scale_search": True}
    assert SurogateConfig(format="nf4", nf4_scale_search=False).format_options()["scale_search"] is False
    with pytest.raises(ValueError, match=r"nf4_scale_search=False is an option of format='nf4'"):
        SurogateConfig(format="nvfp4", nf4_scale_search=False)
    with pytest.raises(ValueError, match=r"SurogateConfig: unsupported nf4_block_size 32"):
        NF4Options.from_config({"nf4_block_size": 32})
    assert SurogateConfig(format="fp8", block_size="tensor").format_options() == {"block_size": None, "ue8m0": False}


# ---------------------------------------------------------------------------- a format added in one class
@dataclasses.dataclass(frozen=True)
class _HalfOptions(Options):
    scale: float = 1.0

    def validate(self):
        if not self.scale > 0:
            from surogate_hf.nn.formats import OptionError

            raise OptionError("scale", f"{{opt}} must be positive, got {self.scale!r}")


class _HalfFormat(Format):
    """A toy format: the weight in fp16 times a fixed scale (exercises the seams, not a real format)."""

    name = "toy_half"
    options_class = _HalfOptions

    def __init__(self, scale: float = 1.0):
        self.options = _HalfOptions(scale)

    def slots(self, n, k, expert=False):
        return {"": ((n, k), torch.float16), "_scale": ((), torch.float32)}

    def quantize(self, w, expert=False):
        s = torch.tensor(self.options.scale, dtype=torch.float32)
        return {"": (w.float() / s).to(torch.float16), "_scale": s}

    def dequantize(self, t, n, k, dtype):
        return (t[""].float() * t["_scale"]).to(dtype)

    def linear(self, x, t, n, k):
        return x @ self.dequantize(t, n, k, x.dtype).t()

    def dgrad(self, dy, t, n, k):
        return dy @ self.dequantize(t, n, k, dy.dtype)

    def bytes_per_param(self):
        return 2.0

    def checkpoint_config(self, dense_names):
        return {"quant_method": "toy_half", "modules_to_not_convert": dense_names}


@pytest.fixture
def toy_format():
    register(_HalfFormat)
    try:
        yield "toy_half"
    finally:
        FORMAT_CLASSES.pop("toy_half", None)
        L.LINEAR_CLASSES.pop("toy_half", None)


def test_a_registered_format_runs_through_the_module_swap(toy_format):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(4, 32)
    ref = model(x)
    with pytest.raises(ValueError, match="scale must be positive"):
        make_format(toy_format, scale=0.0)
    report = replace_with_quantized_modules(model, toy_format, {"scale": 0.5})
    assert report.quantized == ["0", "2"]
    for name in report.quantized:  # swapped on meta, as before a checkpoint loads
        m = model.get_submodule(name)
        assert type(m).__name__ == "TOY_HALFLinear" and m.quant_format == toy_format
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    for name in ("0", "2"):
        q = L.linear_class(toy_format).from_linear(dense.get_submodule(name), scale=0.5)
        model.set_submodule(name, q)
    x.requires_grad_(True)
    y = model(x)
    torch.testing.assert_close(y, ref, atol=2e-2, rtol=2e-2)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    m = model.get_submodule("0")
    out = m.fmt.to_checkpoint(m._tensors(), 16, 32, "0.", torch.float32)
    assert sorted(out) == ["0.weight", "0.weight_scale"]
    assert m.fmt.checkpoint_config(["2"])["modules_to_not_convert"] == ["2"]


def test_registering_a_name_twice_is_an_error():
    with pytest.raises(ValueError, match="registered twice"):
        register(type(make_format("fp8")))
