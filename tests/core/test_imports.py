"""The package's imports point one way: core < backends < pipeline < the public modules < integrations, no cycles.

Every module is parsed (not imported), relative imports are resolved, and each import of another
module of the package is an edge. Imports inside functions count too: a lazy import is still a
dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "flash_attn_ck"
# Layer of each top-level part of the package; a module may import only its own layer or lower ones.
LAYERS = {"core": 0, "backends": 1, "pipeline": 2,
          "ops": 4, "api": 4, "__init__": 4, "__main__": 4, "integrations": 5}


def module_name(path: Path) -> str:
    parts = ["flash_attn_ck", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that `name` imports (`from . import x` counts as module x when it is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known and m != name}


def layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS["__init__" if len(parts) == 1 else parts[1]]


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_every_module_has_a_layer():
    assert {name.split(".")[1] for name in modules() if "." in name} <= set(LAYERS)


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{name} -> {target}" for name, targets in graph().items() for target in sorted(targets)
              if layer(target) > layer(name)]
    assert not upward, "imports running up a layer:\n" + "\n".join(upward)


def test_no_import_cycles():
    edges = graph()
    # A package's __init__ re-exporting its own modules is not a cycle of design: drop package -> child edges.
    edges = {name: {t for t in targets if not t.startswith(name + ".")} for name, targets in edges.items()}
    state: dict[str, str] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*stack[stack.index(target):], node, target]) if target in stack
                              else f"{node} -> {target}")
            elif target not in state:
                visit(target, [*stack, node])
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


TRITON = "flash_attn_ck.backends.triton"
# Inside the Triton backend: which parts a part may import (config, the tile tables, any of them).
TRITON_PARTS = {"runtime": {"runtime", "one_launch", "gluon"}, "one_launch": {"one_launch", "runtime"},
                "gluon": {"gluon", "runtime"}, "operators": {"operators", "one_launch", "gluon", "runtime"},
                "backend": {"backend", "operators", "runtime"}}


def triton_part(name: str) -> str | None:
    """The part of the Triton backend a module belongs to (its folder, or operators / backend), None for the rest."""
    if not name.startswith(TRITON + "."):
        return None
    return name.removeprefix(TRITON + ".").split(".")[0]


def test_the_triton_kernel_families_import_neither_each_other_nor_the_dispatch():
    """backends/triton: the kernel families (one_launch/, gluon/) import each other nowhere, the runtime (launch
    specs, replay, schedules) builds their launches but chooses nothing, and only backend.py reads the operator
    lists; a family's mask rule is its own."""
    found = [f"{name} -> {target}" for name, targets in graph().items() for target in sorted(targets)
             if (part := triton_part(name)) in TRITON_PARTS and triton_part(target) not in (None, "config")
             and triton_part(target) not in TRITON_PARTS[part]]
    assert not found, "imports across the Triton backend's parts:\n" + "\n".join(found)
    assert {triton_part(name) for name in modules()} - {None, "config"} == set(TRITON_PARTS)
