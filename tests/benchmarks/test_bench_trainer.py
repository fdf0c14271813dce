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

    def fake_trainer(recipe, layers, batch, seq, warmup, steps, out, model=None, compile_mode=None):
        calls.append((model, compile_mode))
        return speeds[model], "adamw_torch_fused (AdamW)"

    monkeypatch.setattr(T, "trainer", fake_trainer)
    monkeypatch.setattr(T, "QLORA_BUILDS", {k: (f"setup {k}", lambda layers, k=k: k) for k in ("peft", "nf4", "mxfp4")})
    monkeypatch.setattr(T, "write_result", lambda name, title, body: written.update(body=body))
    monkeypatch.setattr(sys, "argv", ["bench_trainer.py", "--shape", "smollm2-135m", *argv])
    T.main()
    return calls, written.get("body", "")


def test_qlora_setups_run_through_the_trainer_against_peft(monkeypatch):
    calls, body = _run(monkeypatch, ["--qlora", "peft,nf4,mxfp4", "--torch-compile-mode", "reduce-overhead"],
                       {"peft": 100.0, "nf4": 99.0, "mxfp4": 102.0})
    assert calls == [("peft", "reduce-overhead"), ("nf4", "reduce-overhead"), ("mxfp4", "reduce-overhead")]
    assert "torch_compile_mode='reduce-overhead'" in body
    assert "| 0.990 |" in body and "| 1.020 |" in body  # x PEFT, from the same process


def test_bad_options_are_refused(monkeypatch):
    with pytest.raises(SystemExit, match="unknown setup"):
        _run(monkeypatch, ["--qlora", "peft,nf5"], {})
    with pytest.raises(SystemExit, match="applies to --qlora"):
        _run(monkeypatch, ["--torch-compile-mode", "default"], {})
