"""surogate_hf.loftq_init: LoftQ adapters over every quantized format reduce ||W - (deq(W_q) + s*B@A)||, the
report is what the modules hold, more iterations never hurt, training still works, bad input is named."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import surogate_hf
from surogate_hf.testing.models import sample_input_ids, save_tiny_model
from surogate_hf.nn.linear import QuantizedLinear

FORMATS = ("fp8", "nvfp4", "mxfp4", "nf4")
# fp8 blocks of 128x128 would cover a whole tiny weight: 32x32 blocks give fp8 several blocks per weight
OPTIONS = {"fp8": {"block_size": (32, 32)}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("loftq") / "m", seed=0, num_hidden_layers=2)


def peft_model(path, fmt, r=8, seed=0):
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=surogate_hf.SurogateConfig(format=fmt, **OPTIONS.get(fmt, {})), dtype=torch.bfloat16
    )
    model = surogate_hf.prepare_for_training(model, gradient_checkpointing=False)
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear"))


def lora_layers(model):
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and isinstance(m.get_base_layer(), QuantizedLinear)}


@torch.no_grad()
def effective_error(module, w):
    """Relative Frobenius error of what the layer computes: deq(W_q) + scaling * B @ A against w."""
    base = module.get_base_layer()
    a, b = module.lora_A["default"].weight.float(), module.lora_B["default"].weight.float()
    eff = base.dequantize(torch.float32) + module.scaling["default"] * (b @ a)
    return float((w - eff).norm() / w.norm())


@pytest.mark.parametrize("fmt", FORMATS)
def test_loftq_reduces_the_weight_error_of_every_layer(ckpt, fmt):
    dense = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).state_dict()
    model = peft_model(ckpt, fmt)
    layers = lora_layers(model)
    assert len(layers) == 2 * 7
    plain = {n: effective_error(m, dense[n[len("base_model.model."):] + ".weight"].float()) for n, m in layers.items()}
    report = surogate_hf.loftq_init(model, ckpt, iters=2)
    assert set(report) == set(layers)
    for n, m in layers.items():
        w = dense[n[len("base_model.model."):] + ".weight"].float()
        after = effective_error(m, w)
        assert report[n]["plain"] == pytest.approx(plain[n], rel=1e-4)  # B = 0 at PEFT's init: the base alone
        assert report[n]["loftq"] == pytest.approx(after, rel=1e-3, abs=1e-6)  # the report is what the layer holds
        assert after < 0.97 * plain[n], (n, plain[n], after)


@pytest.mark.slow
def test_more_iterations_never_hurt_and_the_sources_agree(ckpt):
    dense_model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    one = surogate_hf.loftq_init(peft_model(ckpt, "mxfp4"), ckpt, iters=1)
    three = surogate_hf.loftq_init(peft_model(ckpt, "mxfp4"), dense_model, iters=3)  # the dense model as the source
    default = surogate_hf.loftq_init(peft_model(ckpt, "mxfp4"), iters=3)  # the directory it was loaded from
    for n in one:
        assert three[n]["loftq"] <= one[n]["loftq"] + 1e-7
        assert three[n] == default[n]
    assert sum(v["loftq"] for v in three.values()) < sum(v["loftq"] for v in one.values())


def test_training_after_loftq_lowers_the_loss(ckpt):
    model = peft_model(ckpt, "mxfp4")
    surogate_hf.loftq_init(model, ckpt, iters=2)
    ids = sample_input_ids(model.config.vocab_size, batch=4, seq=16)
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.float32 for p in params)  # the adapters keep their master dtype
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in params)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_bad_input_is_named(ckpt, tmp_path):
    model = peft_model(ckpt, "fp8")
    with pytest.raises(ValueError, match="iters must be in 1..5"):
        surogate_hf.loftq_init(model, ckpt, iters=0)
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory"):
        surogate_hf.loftq_init(model, tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="no .safetensors file"):
        surogate_hf.loftq_init(model, tmp_path)
    with pytest.raises(KeyError, match="model.layers.0.self_attn.q_proj.weight"):
        surogate_hf.loftq_init(model, {"unrelated.weight": torch.zeros(1)})
    dense = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    for p in dense.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no LoRA layer"):
        surogate_hf.loftq_init(get_peft_model(dense, LoraConfig(r=4, target_modules="all-linear")), ckpt)


@torch.no_grad()
def _output_errors(model, dense, ids):
    """{layer: relative error of its output against x @ W^T} over the inputs the layer sees for ids."""
    errs, handles = {}, []
    for n, m in lora_layers(model).items():
        w = dense[n[len("base_model.model."):] + ".weight"].float()

        def hook(mod, args, out, w=w, n=n):
            ref = args[0].float() @ w.t()
            errs[n] = float((out.float() - ref).norm() / ref.norm())

        handles.append(m.register_forward_hook(hook))
    model(input_ids=ids)
    for h in handles:
        h.remove()
    return errs


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_calibrated_init_fits_the_layer_outputs_better_than_the_weights_fit(ckpt, fmt):
    """With calibration inputs the rank-r fit minimises each layer's output error over them: on those inputs every
    layer's output error is below the plain base's, and in sum below what the weight-space fit (LoftQ) reaches;
    the report states that metric (output error of the base alone as 'plain')."""
    dense = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).state_dict()
    cal = [sample_input_ids(256, batch=4, seq=32, seed=s) for s in range(3)]
    ids = torch.cat(cal)
    model = peft_model(ckpt, fmt)
    plain = _output_errors(model, dense, ids)
    frob = peft_model(ckpt, fmt)
    surogate_hf.loftq_init(frob, ckpt, iters=1)
    frob_err = _output_errors(frob, dense, ids)
    report = surogate_hf.loftq_init(model, ckpt, iters=1, calibration=cal)
    calibrated = _output_errors(model, dense, ids)
    for n in plain:
        assert calibrated[n] < plain[n], (n, plain[n], calibrated[n])
        assert report[n]["loftq"] < report[n]["plain"]
    assert sum(calibrated.values()) < sum(frob_err.values())


def test_calibration_in_groups_and_bad_calibration_are_named(ckpt):
    """A memory budget smaller than one layer's second moment calibrates layer by layer (each group in its own
    passes, after the earlier ones got their adapters); empty or unusable calibration is named."""
    cal = [sample_input_ids(256, batch=2, seq=16, seed=s) for s in range(2)]
    one_pass = surogate_hf.loftq_init(peft_model(ckpt, "mxfp4"), ckpt, calibration=cal)
    grouped = surogate_hf.loftq_init(peft_model(ckpt, "mxfp4"), ckpt, calibration=[{"input_ids": c} for c in cal],
                                     calibration_memory=1)
    assert set(one_pass) == set(grouped)
    first = next(iter(one_pass))  # the first layer sees the same inputs either way
    assert grouped[first] == pytest.approx(one_pass[first], rel=1e-5)
    assert all(v["loftq"] < v["plain"] for v in grouped.values())
    model = peft_model(ckpt, "mxfp4")
    with pytest.raises(ValueError, match="calibration holds no batch"):
        surogate_hf.loftq_init(model, ckpt, calibration=[])
    with pytest.raises(TypeError, match="calibration batches must be"):
        surogate_hf.loftq_init(model, ckpt, calibration=[[1, 2, 3]])
    with pytest.raises(ValueError, match="damp must be > 0"):
        surogate_hf.loftq_init(model, ckpt, calibration=cal, damp=0)


@pytest.mark.parametrize("fmt", ["mxfp4", "nf4"])
def test_loftq_init_with_gptq_fits_the_outputs_better(ckpt, fmt):
    """quantizer='gptq' re-encodes each base with GPTQ codes before the activation-aware adapters: on the
    calibration inputs the summed output error is below round-to-nearest's, and the report states it."""
    dense = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).state_dict()
    cal = [sample_input_ids(256, batch=4, seq=32, seed=s) for s in range(3)]
    ids = torch.cat(cal)
    rounded = peft_model(ckpt, fmt)
    surogate_hf.loftq_init(rounded, ckpt, calibration=cal)
    gptq = peft_model(ckpt, fmt)
    report = surogate_hf.loftq_init(gptq, ckpt, calibration=cal, quantizer="gptq")
    assert all(v["loftq"] <= v["plain"] for v in report.values())
    assert sum(_output_errors(gptq, dense, ids).values()) < sum(_output_errors(rounded, dense, ids).values())


def test_loftq_init_gptq_options_are_named(ckpt):
    model = peft_model(ckpt, "nvfp4")
    cal = [sample_input_ids(256, batch=2, seq=16, seed=0)]
    with pytest.raises(ValueError, match="quantizer='gptq' .* pass calibration="):
        surogate_hf.loftq_init(model, ckpt, quantizer="gptq")
    with pytest.raises(ValueError, match="quantizer must be one of"):
        surogate_hf.loftq_init(model, ckpt, calibration=cal, quantizer="awq")
    with pytest.raises(ValueError, match="gptq_damp must be > 0"):
        surogate_hf.loftq_init(model, ckpt, calibration=cal, quantizer="gptq", gptq_damp=0)


@pytest.mark.parametrize("shape", [(48, 20), (20, 48)])
def test_low_rank_factors_are_the_truncated_svd(shape):
    from surogate_hf.integrations.loftq import _low_rank_factors

    e = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    left, right = _low_rank_factors(e, 6)
    u, s, vh = torch.linalg.svd(e.double(), full_matrices=False)
    best = (u[:, :6] * s[:6]) @ vh[:6]
    assert torch.allclose((left @ right).double(), best, atol=1e-5)
    # sqrt of the singular values on each side
    assert torch.allclose(left.double().norm(dim=0) ** 2, s[:6], rtol=1e-4)
    assert torch.allclose(right.double().norm(dim=1) ** 2, s[:6], rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", FORMATS)
def test_loftq_on_cuda_matches_the_cpu_result(ckpt, fmt):
    """On the GPU the bases quantize through the kernels (bit-exact to the references), so the init and its
    report agree with the CPU run up to the float64 factorisation's rounding."""
    cpu = surogate_hf.loftq_init(peft_model(ckpt, fmt), ckpt, iters=2)
    model = AutoModelForCausalLM.from_pretrained(
        ckpt, quantization_config=surogate_hf.SurogateConfig(format=fmt, **OPTIONS.get(fmt, {})),
        dtype=torch.bfloat16, device_map="cuda",
    )
    model = surogate_hf.prepare_for_training(model, gradient_checkpointing=False)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    gpu = surogate_hf.loftq_init(model, ckpt, iters=2)
    for n in cpu:
        assert gpu[n]["loftq"] < gpu[n]["plain"]
        assert gpu[n]["plain"] == pytest.approx(cpu[n]["plain"], rel=1e-3)
        assert gpu[n]["loftq"] == pytest.approx(cpu[n]["loftq"], rel=2e-2)
    ids = sample_input_ids(model.config.vocab_size, batch=2, seq=16).cuda()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
