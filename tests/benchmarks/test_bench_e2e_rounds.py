"""bench_e2e.py's --rounds: setups interleaved round by round, the median reported with its spread (the timing itself
runs on the GPU machine; here run_setup is replaced by a recorded sequence of results)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_e2e as E  # noqa: E402


def test_rounds_interleave_setups_and_report_medians(monkeypatch):
    order, written = [], {}
    speeds = {"peft_bf16": iter([100.0, 300.0, 200.0]), "ours_nf4": iter([90.0, 330.0, 250.0])}

    host_ms = {"peft_bf16": iter([80.0, 95.0, 90.0]), "ours_nf4": iter([70.0, 60.0, 65.0])}

    def fake_run(key, layers, batch, seq, warmup, steps):
        order.append(key)
        return next(speeds[key]), 1.0, 2_000_000, 0.5, next(host_ms[key]), 100.0

    monkeypatch.setattr(E, "run_setup", fake_run)
    monkeypatch.setattr(E, "write_result", lambda name, title, body: written.update(body=body))
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--shape", "smollm2-360m", "--setups", "peft_bf16,ours_nf4",
                                      "--rounds", "3", "--name", "t"])
    E.main()
    assert order == ["peft_bf16", "ours_nf4"] * 3
    body = written["body"]
    assert "3 rounds (setups interleaved; medians)" in body
    assert "| 200 |" in body.replace(",", "") and "| 250 |" in body.replace(",", "")  # the medians
    assert "1.25x PEFT LoRA" in body  # the ratio of the medians: 250 / 200
    assert "median of 3 rounds, 90-330 tok/s" in body
    # the host CPU time a step: its own median and spread over the rounds
    assert "host CPU 90.0 ms a step (process time, every thread; rounds 80.0-95.0" in body
    assert "host CPU 65.0 ms a step (process time, every thread; rounds 60.0-70.0" in body


def test_every_target_names_known_setups():
    """A ratio's peer must be a setup (a misspelt one would silently never be measured)."""
    for key, peers in {**E.TARGETS, **E.SMALL_MODEL_TARGETS}.items():
        assert key in E.SETUPS, key
        for peer, ratio in peers:
            assert peer in E.SETUPS and ratio > 0, (key, peer)


def test_setup_environments_name_known_setups_and_are_restored(monkeypatch):
    """SETUP_ENV's variables apply to their setup's run only (the C++ route reads SUROGATE_HF_MIXED_INPUT per call, so
    a leftover value would change every later setup in the process)."""
    import os

    for key in E.SETUP_ENV:
        assert key in E.SETUPS, key
    seen = []
    monkeypatch.delenv("SUROGATE_HF_MIXED_INPUT", raising=False)
    monkeypatch.setattr(E, "_run_setup", lambda key, *a: seen.append(os.environ.get("SUROGATE_HF_MIXED_INPUT")))
    E.run_setup("ours_mxfp4_compiled_model_mixed_input", 1, 1, 8, 0, 1)
    E.run_setup("ours_mxfp4_compiled_model", 1, 1, 8, 0, 1)
    assert seen == ["1", None] and "SUROGATE_HF_MIXED_INPUT" not in os.environ


def test_whole_model_setups_compile_the_model_as_the_trainer_does(monkeypatch):
    """The `_compiled_model` setups hand the built model to torch.compile whole, with --compile-mode's kwargs
    (TrainingArguments(torch_compile=True) goes through accelerate's torch.compile(model))."""
    import torch

    from surogate_hf.nn import linear as L

    built = torch.nn.Linear(4, 4)
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append((model, kw)) or "compiled")
    monkeypatch.setattr(E, "COMPILE_KWARGS", {"mode": "reduce-overhead"})
    monkeypatch.setattr(L, "COMPILED_DECODED_ROUTE", False)
    assert E.compiled_model(lambda layers: built)(2) == "compiled"
    assert calls == [(built, {"mode": "reduce-overhead"})]
    assert L.COMPILED_DECODED_ROUTE is True  # the extension's graph ops, as the per-layer setups use
    for fmt in ("fp8", "nf4", "nvfp4", "mxfp4"):
        assert ("peft_bf16_compiled_model", 1.0) in E.TARGETS[f"ours_{fmt}_compiled_model"]


def test_the_table_is_rewritten_after_each_run(monkeypatch):
    """A run stopped by a time limit leaves the setups it measured: the table is written after every setup run,
    marked partial and naming the setups still to run, then once more in full."""
    bodies = []

    def fake_run(key, layers, batch, seq, warmup, steps):
        return {"peft_bf16": 100.0, "ours_nf4": 120.0}[key], 1.0, 2_000_000, 0.5, 50.0, 60.0

    monkeypatch.setattr(E, "run_setup", fake_run)
    monkeypatch.setattr(E, "write_result", lambda name, title, body: bodies.append(body))
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--shape", "smollm2-360m", "--setups", "peft_bf16,ours_nf4",
                                      "--name", "t"])
    E.main()
    assert len(bodies) == 3
    assert "PARTIAL: written after 1 of 2 setup runs" in bodies[0] and "not run yet" in bodies[0]
    assert "PARTIAL: written after 2 of 2 setup runs" in bodies[1] and "1.20x PEFT LoRA" in bodies[1]
    assert "PARTIAL" not in bodies[2] and "not run yet" not in bodies[2] and "1.20x PEFT LoRA" in bodies[2]


def test_causal_mask_policy_follows_the_flag(monkeypatch):
    """Every setup gets surogate_hf's compiled causal-mask skip (where this torch needs it), or transformers' stock
    mask function under --stock-causal-mask."""
    from surogate_hf.integrations import causal_mask as CM

    calls = []
    monkeypatch.setattr(CM, "install_compiled_causal_mask_skip", lambda: calls.append("install"))
    monkeypatch.setattr(CM, "uninstall_compiled_causal_mask_skip", lambda: calls.append("uninstall"))
    monkeypatch.setattr(E, "STOCK_CAUSAL_MASK", [])
    E.causal_mask_policy()
    monkeypatch.setattr(E, "STOCK_CAUSAL_MASK", [True])
    E.causal_mask_policy()
    assert calls == ["install", "uninstall"]


def test_keep_models_builds_each_setup_once_and_times_it_each_round_under_its_environment(monkeypatch):
    """--keep-models: one Prepared (model build and compile) per setup, timed once a round, setups interleaved; the
    first round after --warmup untimed steps, later ones after one; each block under its setup's SETUP_ENV."""
    import os

    built, timed, written = [], [], {}

    class FakePrepared:
        def __init__(self, key, layers, batch, seq):
            built.append(key)

        def time(self, key, warmup, steps, batch, seq):
            timed.append((key, warmup, os.environ.get("SUROGATE_HF_MIXED_INPUT")))
            return 100.0, 1.0, 2_000_000, 0.5, 50.0, 60.0

    monkeypatch.delenv("SUROGATE_HF_MIXED_INPUT", raising=False)
    monkeypatch.setattr(E, "Prepared", FakePrepared)
    monkeypatch.setattr(E, "write_result", lambda name, title, body: written.update(body=body))
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--shape", "smollm2-135m", "--setups",
                                      "peft_bf16_compiled_model,ours_mxfp4_compiled_model_decode_route",
                                      "--rounds", "2", "--warmup", "3", "--keep-models", "--name", "t"])
    E.main()
    assert built == ["peft_bf16_compiled_model", "ours_mxfp4_compiled_model_decode_route"]
    assert timed == [("peft_bf16_compiled_model", 3, None), ("ours_mxfp4_compiled_model_decode_route", 3, "0"),
                     ("peft_bf16_compiled_model", 1, None), ("ours_mxfp4_compiled_model_decode_route", 1, "0")]
    assert "SUROGATE_HF_MIXED_INPUT" not in os.environ
    assert "built and compiled once and kept (--keep-models" in written["body"]
