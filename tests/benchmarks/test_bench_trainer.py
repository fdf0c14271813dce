"""bench_trainer.py's --qlora mode: each QLoRA setup through the Trainer against PEFT's Trainer run in the same
process, with the Trainer's compile switch passed through (the timing itself runs on the GPU machine; here the Trainer
run is replaced by recorded results)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_trainer as T  # noqa: E402


def _run(monkeypatch, argv, speeds):
    calls, written = [], {}

    def fake_trainer(recipe, layers, batch, seq, warmup, steps, out, model=None, compile_mode=None, profile_to=None):
        calls.append((model, compile_mode, profile_to))
        return speeds[model], "adamw_torch_fused (AdamW)"

    def fake_plain(build, layers, batch, seq, warmup, steps, compile_mode=None):
        calls.append(("plain", build(layers), compile_mode))
        return speeds[build(layers)] * 2, "step ms median 1.0 (1.0-1.0)"

    monkeypatch.setattr(T, "trainer", fake_trainer)
    monkeypatch.setattr(T, "plain_qlora", fake_plain)
    monkeypatch.setattr(T, "QLORA_BUILDS", {k: (f"setup {k}", lambda layers, k=k: k) for k in ("peft", "nf4", "mxfp4")})
    monkeypatch.setattr(T, "write_result", lambda name, title, body: written.update(body=body))
    monkeypatch.setattr(sys, "argv", ["bench_trainer.py", "--shape", "smollm2-135m", *argv])
    T.main()
    return calls, written.get("body", "")


def test_qlora_setups_run_through_the_trainer_against_peft(monkeypatch):
    calls, body = _run(monkeypatch, ["--qlora", "peft,nf4,mxfp4", "--torch-compile-mode", "reduce-overhead"],
                       {"peft": 100.0, "nf4": 99.0, "mxfp4": 102.0})
    assert calls == [("peft", "reduce-overhead", None), ("nf4", "reduce-overhead", None),
                     ("mxfp4", "reduce-overhead", None)]
    assert "torch_compile_mode='reduce-overhead'" in body
    assert "| 0.990 |" in body and "| 1.020 |" in body  # x PEFT, from the same process


def test_plain_loop_and_profile_ride_along(monkeypatch, tmp_path):
    calls, body = _run(monkeypatch, ["--qlora", "peft,nf4", "--torch-compile-mode", "default", "--plain",
                                     "--profile-dir", str(tmp_path)], {"peft": 100.0, "nf4": 99.0})
    assert calls == [("peft", "default", f"{tmp_path}/trainer_peft.txt"), ("plain", "peft", "default"),
                     ("nf4", "default", f"{tmp_path}/trainer_nf4.txt"), ("plain", "nf4", "default")]
    assert "Trainer x plain loop" in body and "| 0.500 |" in body  # the Trainer's tok/s over the plain loop's


def test_attention_mask_flags_reach_bench_e2e(monkeypatch):
    """--use-cache / --stock-causal-mask are bench_e2e's switches (the models it builds, the mask policy it applies),
    and the table says which ran."""
    monkeypatch.setattr(T.E, "USE_CACHE", [])
    monkeypatch.setattr(T.E, "STOCK_CAUSAL_MASK", [])
    _, body = _run(monkeypatch, ["--qlora", "peft", "--use-cache", "--stock-causal-mask"], {"peft": 100.0})
    assert T.E.USE_CACHE == [True] and T.E.STOCK_CAUSAL_MASK == [True]
    assert "use_cache=True" in body and "stock SDPA mask function" in body


def test_bad_options_are_refused(monkeypatch):
    with pytest.raises(SystemExit, match="unknown setup"):
        _run(monkeypatch, ["--qlora", "peft,nf5"], {})
    for opt in (["--torch-compile-mode", "default"], ["--plain"], ["--profile-dir", "/tmp/x"]):
        with pytest.raises(SystemExit, match=f"{opt[0]} applies to --qlora"):
            _run(monkeypatch, opt, {})


def test_rounds_build_each_trainer_once_and_time_the_later_rounds(monkeypatch):
    """--rounds: every setup's Trainer is built once and trained again round by round, setups in turn; the first
    round (the compile) is untimed, the table gives medians and each round's ratio to PEFT's same round."""
    built, ran, written = [], [], {}
    speeds = {"peft": [1.0, 100.0, 90.0, 110.0], "nf4": [1.0, 95.0, 99.0, 100.0]}

    def fake_rounds(recipe, layers, batch, seq, warmup, steps, out, model=None, compile_mode=None, profile_to=None):
        built.append((model, compile_mode))

        def run():
            ran.append(model)
            return speeds[model][sum(1 for m in ran if m == model) - 1], "adamw_torch_fused (AdamW)"

        return object(), run

    monkeypatch.setattr(T, "trainer_rounds", fake_rounds)
    monkeypatch.setattr(T, "QLORA_BUILDS", {k: (f"setup {k}", lambda layers, k=k: k) for k in ("peft", "nf4")})
    monkeypatch.setattr(T, "write_result", lambda name, title, body: written.update(body=body))
    monkeypatch.setattr(sys, "argv", ["bench_trainer.py", "--shape", "smollm2-135m", "--qlora", "peft,nf4",
                                      "--torch-compile-mode", "reduce-overhead", "--rounds", "4"])
    T.main()
    assert built == [("peft", "reduce-overhead"), ("nf4", "reduce-overhead")]
    assert ran == ["peft", "nf4"] * 4
    body = written["body"]
    assert "| setup peft | 100 |" in body and "| 99.000 | 0.990 |" in body  # medians of rounds 2-4, ratio
    assert "0.950 / 1.100 / 0.909" in body  # per round against PEFT's same round
    with pytest.raises(SystemExit, match="--rounds"):
        monkeypatch.setattr(sys, "argv", ["bench_trainer.py", "--qlora", "peft", "--rounds", "2", "--plain"])
        T.main()


def test_phase_note_splits_the_steps_at_the_trainers_callbacks():
    import bench_trainer as B

    steps = [[s, s + 0.050, s + 0.060, s + 0.062] for s in (0.0, 0.1, 0.2)]
    assert B.phase_note(steps) == ("phases ms fwd+bwd 50.0 / optimizer 10.0 / zero_grad 2.0 / between steps 38.0")
    assert B.phase_note([[0.0, 0.1]]) == "phases: n/a"
