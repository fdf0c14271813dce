"""bench_e2e.py --pyspy: py-spy attached to the benchmark's own process for the timed steps only (a stand-in py-spy
here records how it was called and writes its output on SIGINT, as the real one does)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import analyze_pyspy as A  # noqa: E402
import bench_e2e as E  # noqa: E402
import common  # noqa: E402

FAKE_PYSPY = """#!{python}
import signal, sys, time
args = sys.argv[1:]
out, pid = args[args.index("-o") + 1], args[args.index("--pid") + 1]
open(out + ".started", "w").close()
def stop(*_):
    with open(out, "w") as f:
        f.write(f"thread ({{pid}}): MainThread;time_train_steps_cpu ({timed}) 1 " + " ".join(args) + "\\n")
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
while True:
    time.sleep(0.05)
"""


def test_timed_steps_are_sampled_by_py_spy_attached_after_the_warmup(tmp_path, monkeypatch):
    fake = tmp_path / "py-spy"
    fake.write_text(FAKE_PYSPY.format(python=sys.executable, timed=A.TIMED_LOOP))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(common, "PYSPY_ATTACH_S", 0.5)
    steps = []
    out = tmp_path / "spy.txt"

    def step():
        steps.append((os.path.exists(str(out) + ".started"), out.exists()))
        return torch.ones(())

    common.time_train_steps_cpu(step, 2, 3, str(out), str(fake))
    # started after the two warm-up steps and running through the three timed ones; its output written once it is
    # stopped, after them
    assert steps == [(False, False)] * 2 + [(True, False)] * 3
    text = out.read_text()
    assert f"--pid {os.getpid()}" in text and "--format raw" in text and "--threads" in text
    assert A.TIMED_LOOP in text


def test_a_missing_py_spy_is_an_error_naming_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="--pyspy"):
        common.time_train_steps_cpu(lambda: torch.ones(()), 0, 1, str(tmp_path / "s.txt"), str(tmp_path / "nope"))


def test_timed_loop_names_the_line_of_the_timed_step():
    line = int(A.TIMED_LOOP.split(":")[1])
    source = (Path(common.__file__)).read_text().splitlines()
    assert source[line - 1].strip().startswith("loss = step()")


def test_each_setup_run_gets_its_own_file(monkeypatch, tmp_path):
    monkeypatch.setattr(E, "PYSPY", {})
    assert E.pyspy_file("peft_bf16") is None
    E.PYSPY.update(dir=str(tmp_path), exe="py-spy", runs={})
    names = [os.path.basename(E.pyspy_file(k)) for k in ("peft_bf16", "ours_nf4", "peft_bf16")]
    assert names == ["spy_peft_bf16.txt", "spy_ours_nf4.txt", "spy_peft_bf16_r2.txt"]
