"""The wheel carries what an installed package promises: its licence file and the typing marker."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_has_its_licence_and_typing_marker(tmp_path):
    pytest.importorskip("setuptools")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (wheel,) = tmp_path.glob("flash_attn_ck-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "flash_attn_ck/py.typed" in names
    assert any(name.endswith("licenses/LICENSE") for name in names), names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "License-Expression: BSD-3-Clause" in metadata and "Classifier: Typing :: Typed" in metadata
