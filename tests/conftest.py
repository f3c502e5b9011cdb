"""Every folder of test modules on sys.path (folders.py); a collection where a test's folder and its gpu/rocm
marker disagree is refused. On a torch older than the integrations need, their test files are left out, and the
header says which."""

from __future__ import annotations

import re
import socket
import sys
from pathlib import Path

import pytest

from folders import IMPORT_PATHS, MARKED_FOLDERS, TESTS

sys.path[:0] = [str(path) for path in IMPORT_PATHS if str(path) not in sys.path]


def imports_of(names: set[str]) -> re.Pattern:
    modules = "|".join(re.escape(name) for name in sorted(names))
    return re.compile(rf"^(from|import) (tests\.)?({modules})\b", re.MULTILINE)


def _integrations_unavailable() -> str | None:
    try:
        import flash_attn_ck.integrations  # noqa: F401
    except ImportError as error:
        return str(error)
    return None


def integration_test_files(folder: Path) -> list[str]:
    """Test modules (paths relative to `folder`) that import an integration at module level, directly or through
    another such module."""
    paths = {path.stem: path for path in folder.rglob("*.py")}
    sources = {name: path.read_text() for name, path in paths.items()}
    left_out = {"flash_attn_ck.integrations"}
    while True:
        pattern = imports_of(left_out)
        more = {name for name, text in sources.items() if pattern.search(text)} - left_out
        if not more:
            return sorted(paths[name].relative_to(folder).as_posix() for name in left_out if name.startswith("test_"))
        left_out |= more


WHY_LEFT_OUT = _integrations_unavailable()
collect_ignore = integration_test_files(TESTS) if WHY_LEFT_OUT else []


def misplaced(items) -> list[str]:
    """Items whose gpu/rocm markers are not their folder's: every test under tests/gpu/ carries `gpu`, every one
    under tests/rocm/ `rocm`, and no test elsewhere carries either."""
    wrong = []
    for item in items:
        if not item.path.is_relative_to(TESTS):
            continue
        folder = item.path.relative_to(TESTS).parts[0]
        wanted = {MARKED_FOLDERS[folder]} if folder in MARKED_FOLDERS else set()
        carried = {mark.name for mark in item.iter_markers()} & set(MARKED_FOLDERS.values())
        if carried != wanted:
            wrong.append(f"{item.nodeid}: marked {sorted(carried) or 'neither'}, its folder wants "
                         f"{sorted(wanted) or 'neither'}")
    return wrong


@pytest.hookimpl(tryfirst=True)      # before -m deselects anything
def pytest_collection_modifyitems(config, items):
    if wrong := misplaced(items):
        raise pytest.UsageError("tests whose folder says another place to run (tests/folders.py):\n  "
                                + "\n  ".join(wrong))


def pytest_report_header(config):
    if WHY_LEFT_OUT:
        return [f"left out ({WHY_LEFT_OUT}): {' '.join(collect_ignore)}"]
    return None


@pytest.fixture(scope="module")
def one_process_group():
    """A gloo process group of this process alone (world size 1), for the context-parallel tests of one module."""
    import torch.distributed as dist
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
