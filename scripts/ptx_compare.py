"""Whether this tree's default kernels compile to the same PTX as another tree's, without a GPU.

    git archive REV flash_attn_ck scripts tests | tar -x -C /tmp/old
    python3 scripts/ptx_compare.py /tmp/old [NAME_PART]

Compiles, in each tree (by that tree's own copy of this script, so each spells its kernels' arguments its own way;
the two trees at once) for sm_90a:
  - every default tile of the warp-specialised forward (fwd_ws) and backward (bwd_ws, bwd_ws_split) over a set of
    mask / varlen / deterministic / varlen-schedule variants;
  - the older Triton kernels (attn_fwd_kernel; attn_bwd_kernel, whose dQ pass is its query-tile role) at every head
    block of the sm_90 table over scripts/triton_compile_check.py's variants (plain, causal, a window with ALiBi,
    softcap and dropout, a top-left window with ALiBi; dense and varlen; the backward's modes), each specialised
    as a launch of its arguments would be (ints equal to 1 constant, divisibility by 16), and with v's own head dim
    (triton_compile_check.value_head_dim_variants);
(NAME_PART: only the variants whose names contain it, e.g. "fwd_ws", "attn_bwd_kernel" or "d128"), strips what
only debug information carries (`.loc`, `.file`, comments, `$L__tmp` labels, the debug sections) and prints, per
variant, IDENTICAL or the number of differing lines. Identical PTX means identical machine code: GPU results of
OLD_TREE's kernels (tests, sanitizer, timings) hold for this tree's. Exits 1 if any variant differs or is missing
here; a variant only this tree compiles (a new kernel mode) is listed as new.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


def strip_debug(ptx: str) -> str:
    """The PTX without what only debug information carries."""
    lines = []
    for line in ptx.splitlines():
        if ".section\t.debug" in line or ".section .debug" in line:
            break
        line = re.sub(r"//.*", "", line).rstrip()
        if not line or line.lstrip().startswith((".loc", ".file")) or re.fullmatch(r"\s*\$L__tmp\d+:", line):
            continue
        lines.append(line)
    return "\n".join(lines)


def specs(names: str = ""):
    """(variant name, launch spec) of every variant whose name contains `names` (all by default) at every head dim of
    the tile tables: scripts/triton_compile_check.py's warp-specialised and older kernels."""
    from triton_compile_check import gluon_variants, older_variants, value_head_dim_variants

    from flash_attn_ck.backends.triton import config
    yield from gluon_variants(sorted(set(config.FWD_WS_SM90) | set(config.BWD_WS_SM90)), names)
    yield from older_variants(sorted({d for d, _ in config.SM90}), names)
    yield from value_head_dim_variants(names)


def dump(names: str = "") -> dict[str, str]:
    """Stripped PTX of this process's tree (flash_attn_ck and tests/ first on sys.path), keyed by variant: the Gluon
    kernels compiled as their CPU tests compile them, the older kernels as launched."""
    from triton_compile_check import compile_any
    return {name: strip_debug(compile_any(spec)["asm"]["ptx"]) for name, spec in specs(names)}


def tree_dumps(trees: list[Path], *args: str) -> list[dict[str, str]]:
    """Each tree's own dump (`--dump *args` of its scripts/ptx_compare.py), the trees compiling at once."""
    runs = []
    for tree in trees:
        env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{tree / 'tests'}")
        runs.append(subprocess.Popen([sys.executable, str(tree / "scripts" / "ptx_compare.py"), "--dump", *args],
                                     cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    dumps = []
    for tree, run in zip(trees, runs):
        out, err = run.communicate()
        if run.returncode:
            sys.exit(f"compiling the kernels of {tree} failed:\n{err[-3000:]}")
        dumps.append(json.loads(out))
    return dumps


def main():
    if sys.argv[1:2] == ["--dump"]:
        print(json.dumps(dump(*sys.argv[2:])))
        return
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    names = sys.argv[2] if len(sys.argv) == 3 else ""
    old, new = tree_dumps([Path(sys.argv[1]).resolve(), Path(__file__).resolve().parents[1]], names)
    old = {name: ptx for name, ptx in old.items() if names in name}   # (an older script may dump every variant)
    differ = added = 0
    for name in sorted(set(old) | set(new)):
        if name not in old:
            print(f"{name}: new in this tree (nothing to compare)")
            added += 1
            continue
        if name not in new:
            print(f"{name}: only in OLD_TREE")
            differ += 1
            continue
        a, b = old[name].splitlines(), new[name].splitlines()
        changed = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
        print(f"{name}: " + ("IDENTICAL" if a == b else f"{changed} lines differ"), flush=True)
        differ += a != b
    print(f"{len(old) - differ} of {len(old)} variants identical" + (f"; {added} new in this tree" if added else ""))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
