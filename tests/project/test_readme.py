"""README.md's architecture tree matches the files: every entry it names exists, every package module is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = re.compile(r"^(?P<indent> {0,15})(?P<name>[\w.]+/?)(?: {2,}(?P<text>.*))?$")
PY_NAME = re.compile(r"\b(\w+\.py)\b")
WORD = re.compile(r"\b(\w+)\b")


def architecture_tree(readme: str) -> list[str]:
    section = readme.split("## Architecture", 1)[1]
    return section.split("```", 2)[1].strip("\n").splitlines()


def tree_entries(lines: list[str]) -> dict[str, str]:
    """Path (relative to the repository) -> its description; continuation lines join the entry above."""
    entries: dict[str, str] = {}
    parents: list[str] = []
    path = None
    for line in lines:
        match = ENTRY.match(line)
        if not match:
            entries[path] += " " + line.strip()
            continue
        depth = len(match["indent"]) // 2
        parents = parents[:depth]
        path = "".join(parents) + match["name"]
        if match["name"].endswith("/"):
            parents.append(match["name"])
        entries[path] = match["text"] or ""
    return entries


def entries() -> dict[str, str]:
    return tree_entries(architecture_tree((ROOT / "README.md").read_text()))


def named_files(tree: dict[str, str]) -> set[str]:
    """Every `x.py` the tree names: file entries, and the names in a folder's description."""
    files = {path for path in tree if not path.endswith("/")}
    for path, text in tree.items():
        if path.endswith("/"):
            files |= {path + name for name in PY_NAME.findall(text)}
    return files


def listed_modules(tree: dict[str, str]) -> set[str]:
    """Modules the tree accounts for: named files, a folder's own __init__.py, and a folder's modules named
    without `.py` in its description ("forward, bwd_main, ...")."""
    listed = named_files(tree)
    for path, text in tree.items():
        if path.endswith("/"):
            listed.add(path + "__init__.py")
            listed |= {path + word + ".py" for word in WORD.findall(text)}
    return listed


def test_every_entry_of_the_tree_exists():
    tree = entries()
    missing = sorted(path for path in set(tree) | named_files(tree) if not (ROOT / path).exists())
    assert not missing, f"README.md's architecture tree names what does not exist: {missing}"


def test_every_package_module_is_in_the_tree():
    listed = listed_modules(entries())
    modules = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "flash_attn_ck").rglob("*.py"))
    unlisted = [module for module in modules if module not in listed]
    assert not unlisted, f"package modules README.md's architecture tree does not list: {unlisted}"


def test_the_tree_parser_reads_folders_files_and_continuations():
    lines = ["pkg/                     top", "  a.py                   first", "                           more",
             "  sub/                   b.py: one; c, d"]
    tree = tree_entries(lines)
    assert tree == {"pkg/": "top", "pkg/a.py": "first more", "pkg/sub/": "b.py: one; c, d"}
    assert named_files(tree) == {"pkg/a.py", "pkg/sub/b.py"}
    assert {"pkg/sub/c.py", "pkg/sub/__init__.py", "pkg/__init__.py"} <= listed_modules(tree)
