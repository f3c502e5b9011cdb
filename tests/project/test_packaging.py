"""The wheel and the sdist carry what an installed package and a source build promise: licences (ours and
CK's), the typing marker, the CK library where a build put it, and in the sdist everything the tests need."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CK_LICENSE = ROOT / ".ck" / "composable_kernel" / "LICENSE"     # scripts/ck_fetch.py's tree
STAND_IN_LIBRARY = b"not a real library: the wheel only has to carry it"
WHEEL_SOURCES = ["pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "licenses", "flash_attn_ck"]


def build_wheel(source: Path, out: Path) -> zipfile.ZipFile:
    pytest.importorskip("setuptools")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                          str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (wheel,) = out.glob("flash_attn_ck-*.whl")
    return zipfile.ZipFile(wheel)


def build_sdist(out: Path) -> Path:
    """setuptools' own PEP 517 hook, in this environment: offline, no build isolation."""
    pytest.importorskip("setuptools")
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return out / run.stdout.split()[-1]


def collected_tests(tree: Path) -> tuple[int, list[str]]:
    """pytest --collect-only in `tree`, with the package imported from `tree`: (exit status, test ids)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    return run.returncode, sorted(line for line in run.stdout.splitlines() if "::" in line)


def tracked_files() -> list[str] | None:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    run = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    return [name for name in run.stdout.splitlines() if (ROOT / name).is_file()] if run.returncode == 0 else None


def test_the_wheel_has_its_licences_and_typing_marker(tmp_path):
    wheel = build_wheel(ROOT, tmp_path)
    names = wheel.namelist()
    assert "flash_attn_ck/py.typed" in names
    assert any(name.endswith("licenses/LICENSE") for name in names), names
    assert any(name.endswith("licenses/licenses/LICENSE-CK") for name in names), names
    metadata = wheel.read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "License-Expression: BSD-3-Clause AND MIT" in metadata and "Classifier: Typing :: Typed" in metadata


@pytest.mark.skipif(not CK_LICENSE.is_file(), reason="CK not fetched (python3 scripts/ck_fetch.py)")
def test_the_shipped_ck_licence_is_the_fetched_cks():
    assert (ROOT / "licenses" / "LICENSE-CK").read_bytes() == CK_LICENSE.read_bytes()


def test_a_wheel_built_with_the_ck_library_carries_it_and_the_backend_finds_it(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(ROOT / name, source / name)
    (source / "flash_attn_ck" / "backends" / "ck" / "libflash_attn_ck.so").write_bytes(STAND_IN_LIBRARY)
    wheel = build_wheel(source, tmp_path / "wheel")
    assert wheel.read("flash_attn_ck/backends/ck/libflash_attn_ck.so") == STAND_IN_LIBRARY
    installed = tmp_path / "installed"
    wheel.extractall(installed)
    env = {key: value for key, value in os.environ.items() if key != "FLASH_ATTN_CK_LIBRARY"}
    env["PYTHONPATH"] = str(installed)
    code = "from flash_attn_ck.backends.ck import backend; print(backend.library_path())"
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout.strip()) == installed / "flash_attn_ck" / "backends" / "ck" / "libflash_attn_ck.so"


def test_the_library_is_looked_up_in_the_environment_then_the_package_then_the_build(monkeypatch, tmp_path):
    from flash_attn_ck.backends.ck import backend as ck

    packaged = tmp_path / "libflash_attn_ck.so"
    monkeypatch.setattr(ck, "PACKAGED_LIBRARY", packaged)
    monkeypatch.delenv(ck.LIBRARY_ENV, raising=False)
    assert ck.library_path() == ck.DEFAULT_LIBRARY
    packaged.write_bytes(STAND_IN_LIBRARY)
    assert ck.library_path() == packaged
    monkeypatch.setenv(ck.LIBRARY_ENV, str(tmp_path / "elsewhere.so"))
    assert ck.library_path() == tmp_path / "elsewhere.so"


def test_the_sdist_holds_what_the_build_and_the_tests_need(tmp_path):
    sdist = build_sdist(tmp_path)
    with tarfile.open(sdist) as archive:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}   # Python 3.11.4+, 3.10.12+
        archive.extractall(tmp_path / "unpacked", **safe)
    (tree,) = (tmp_path / "unpacked").iterdir()
    for needed in ["csrc_ck/CMakeLists.txt", "scripts/ck_fetch.py", "scripts/ck_generate.py", "tests/cases.py",
                   "tests/conftest.py", "docs/ck.md", "licenses/LICENSE-CK", "Dockerfile"]:
        assert (tree / needed).is_file(), needed
    assert not list(tree.rglob("*.so")), "a built library has no place in the sdist"
    missing = [name for name in tracked_files() or [] if not (tree / name).is_file()]
    assert not missing, f"tracked files missing from the sdist (MANIFEST.in): {missing}"
    assert collected_tests(tree) == collected_tests(ROOT)


def torch_floor() -> str:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (floor,) = [re.fullmatch(r"torch>=([\d.]+)", dep)[1] for dep in project["dependencies"] if dep.startswith("torch")]
    return floor


def test_the_integrations_name_the_torch_they_need():
    """Without SDPA's provider registry (torch before 2.11, or removed here), each integration's import names
    the package's torch floor."""
    code = ("import importlib, torch.nn.attention as attention\n"
            "if hasattr(attention, 'register_flash_attention_impl'):\n"
            "    del attention.register_flash_attention_impl\n"
            "for name in ('sdpa', 'torch_cp', 'context_parallel', 'hf'):\n"
            "    try:\n"
            "        importlib.import_module('flash_attn_ck.integrations.' + name)\n"
            "    except ImportError as error:\n"
            "        print(name, error)\n"
            "    else:\n"
            "        print(name, 'imported')\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 4 and all(f"needs torch >= {torch_floor()}" in line for line in lines), lines
