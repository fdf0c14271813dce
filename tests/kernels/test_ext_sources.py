"""The native extension's sources are part of the installable package (surogate_hf/_csrc -> csrc/): an installed
wheel can build the optional extension, not only a source checkout."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from surogate_hf.kernels import ext

REPO = Path(__file__).resolve().parents[2]


def test_every_source_the_build_compiles_is_in_the_package():
    assert ext._CSRC.parent.name == "surogate_hf"
    for src in ext.SOURCES:
        assert (ext._CSRC / src).is_file(), src
        assert (ext._CSRC / src).read_bytes() == (REPO / "csrc" / src).read_bytes()


def test_the_wheel_ships_the_sources(tmp_path):
    pytest.importorskip("setuptools", reason="building a wheel without isolation needs setuptools installed")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("surogate_hf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"surogate_hf/_csrc/{s}" for s in ext.SOURCES} <= names
    # and every header they include, transitively
    csrc, todo, headers = REPO / "csrc", [REPO / "csrc" / s for s in ext.SOURCES], set()
    while todo:
        src = todo.pop()
        for inc in re.findall(r'^#include "([^"]+)"', src.read_text(), re.M):
            h = (src.parent / inc).resolve()
            if h not in headers:
                headers.add(h)
                todo.append(h)
    assert headers and {f"surogate_hf/_csrc/{h.relative_to(csrc).as_posix()}" for h in headers} <= names


def _gpus(monkeypatch, caps, arch_list):
    """torch.cuda as seen by ext.arch_flags: these capabilities, a toolkit with these targets"""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: caps[i])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: arch_list)


def test_a_hopper_gpu_is_built_for_sm90a(monkeypatch):
    """A cc 9.0 GPU gets sm_90a (WGMMA: the mixed-input GEMM); other GPUs what torch would pick, PTX for the newest."""
    _gpus(monkeypatch, [(9, 0), (8, 0)], ["sm_80", "sm_90", "sm_100"])
    assert ext.arch_flags() == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
                                "-gencode=arch=compute_90,code=compute_90"]
    assert ext.sm90a_built()
    _gpus(monkeypatch, [(10, 0)], ["sm_80", "sm_90", "sm_100"])
    assert ext.arch_flags() == ["-gencode=arch=compute_100,code=sm_100", "-gencode=arch=compute_100,code=compute_100"]
    assert not ext.sm90a_built()
    # a GPU newer than the toolkit is clamped as torch clamps it, and runs the PTX: no sm_90a code for it
    _gpus(monkeypatch, [(12, 0)], ["sm_80", "sm_90"])
    assert ext.arch_flags() == ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]
    assert not ext.sm90a_built()


def test_a_set_arch_list_is_kept(monkeypatch):
    _gpus(monkeypatch, [(9, 0)], ["sm_90"])
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert ext.arch_flags() == [] and not ext.sm90a_built()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    assert ext.arch_flags() == [] and ext.sm90a_built()


def _registrations(text: str, key: str) -> set[str]:
    """The ext_* names a source text registers kernels for under TORCH_LIBRARY_IMPL(surogate, key, m)."""
    blocks = re.findall(rf"TORCH_LIBRARY_IMPL\(surogate,\s*{key},\s*m\)\s*\{{(.*?)\}}", text, re.S)
    return {name for block in blocks for name in re.findall(r'm\.impl\("ext_(\w+)"', block)}


def test_the_sources_register_a_cuda_kernel_for_every_op_the_loader_expects_and_nothing_undeclared():
    """What ext.load checks after building (a CUDA kernel for each of ext.OPS) is what csrc registers, and every kernel
    csrc registers has a schema (declared in surogate_hf/ops/ext.py, or defined in csrc by TORCH_LIBRARY_FRAGMENT): a
    mismatch would only show on the GPU machine, when the build loads. CPU only: reads the sources."""
    import surogate_hf.ops  # noqa: F401  (declares the schemas)

    text = "\n".join(p.read_text() for p in (REPO / "csrc").rglob("*") if p.suffix in (".cpp", ".cu"))
    cuda, autograd = _registrations(text, "CUDA"), _registrations(text, "AutogradCUDA")
    assert cuda == set(ext.OPS)
    declared = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("surogate::ext_")}
    defined_in_csrc = set(re.findall(r'm\.def\(\s*"(ext_\w+)\(', text))
    assert {f"ext_{n}" for n in cuda | autograd} <= declared | defined_in_csrc
    assert defined_in_csrc == {"ext_decode_registry_set", "ext_decode_registry_release"}
    assert not defined_in_csrc & declared, "a schema is defined twice (Python and C++)"
