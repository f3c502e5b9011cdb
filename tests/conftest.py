"""On a torch older than the integrations need, their test files are left out, and the header says which."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest


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
    """Test modules that import an integration at module level, directly or through another such module."""
    sources = {path.stem: path.read_text() for path in folder.glob("*.py")}
    left_out = {"flash_attn_ck.integrations"}
    while True:
        pattern = imports_of(left_out)
        more = {name for name, text in sources.items() if pattern.search(text)} - left_out
        if not more:
            return sorted(f"{name}.py" for name in left_out if name.startswith("test_"))
        left_out |= more


WHY_LEFT_OUT = _integrations_unavailable()
collect_ignore = integration_test_files(Path(__file__).parent) if WHY_LEFT_OUT else []


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
