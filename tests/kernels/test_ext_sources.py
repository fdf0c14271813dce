"""The native extension's sources are part of the installable package (surogate_hf/_csrc -> csrc/): an installed
wheel can build the optional extension, not only a source checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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
