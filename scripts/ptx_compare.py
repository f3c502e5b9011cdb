"""Whether this tree's default Gluon kernels compile to the same PTX as another tree's, without a GPU.

    git archive REV flash_attn_ck tests | tar -x -C /tmp/old
    python3 scripts/ptx_compare.py /tmp/old

Compiles, in each tree, every default tile of the warp-specialised forward (fwd_ws) and backward (bwd_ws,
bwd_ws_split) for sm_90a over a set of mask / varlen / deterministic variants, strips what only debug information
carries (`.loc`, `.file`, comments, `$L__tmp` labels, the debug sections) and prints, per variant, IDENTICAL or the
number of differing lines. Identical PTX means identical machine code: GPU results of OLD_TREE's kernels (tests,
sanitizer, timings) hold for this tree's. Exits 1 if any variant differs.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

# (head dim, causal, (TOP_LEFT, HAS_LEFT, HAS_RIGHT), varlen, deterministic)
VARIANTS = [(d, causal, (False, False, causal), False, False) for d in (64, 128, 256) for causal in (False, True)] + \
           [(d, True, (True, True, True), True, True) for d in (64, 128, 256)]


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


def dump() -> dict[str, str]:
    """Stripped PTX of this process's tree (flash_attn_ck and tests/ first on sys.path), keyed by variant."""
    import torch
    from gluon_compile import compile_sm90, descriptor_type

    from flash_attn_ck.backends.triton import bwd_ws, bwd_ws_split, config, fwd_ws

    def accepted(kernel, values):   # an older tree's kernel may lack a newer constexpr
        names = inspect.signature(kernel.fn).parameters
        return {k: v for k, v in values.items() if k in names}

    out = {}
    for d, causal, masks, varlen, deterministic in VARIANTS:
        masked = dict(VARLEN=varlen, TOP_LEFT=masks[0], HAS_LEFT=masks[1], HAS_RIGHT=masks[2])
        tile = config.FWD_WS_SM90[d][causal]
        rows = tile.block_m // getattr(tile, "consumers", 2)
        types = dict(q_desc=descriptor_type(rows, d, torch.bfloat16), o_desc=descriptor_type(rows, d, torch.bfloat16),
                     k_desc=descriptor_type(tile.block_n, d, torch.bfloat16),
                     v_desc=descriptor_type(tile.block_n, d, torch.bfloat16),
                     Out="*bf16", Lse="*fp32", cu_seqlens_q="*i32", cu_seqlens_k="*i32", scale="fp32")
        cx = accepted(fwd_ws.attn_fwd_ws_kernel, dict(
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, HEAD_D=d, NUM_STAGES=tile.num_stages, OVERLAP=tile.overlap,
            PINGPONG=tile.pingpong, CONSUMER_REGS=tile.consumer_regs, LOADER_REGS=tile.loader_regs,
            QUERY_MAJOR=False, CONSUMERS=getattr(tile, "consumers", 2), **masked))
        out[f"fwd_ws d{d} causal={causal} varlen={varlen}"] = strip_debug(
            compile_sm90(fwd_ws.attn_fwd_ws_kernel, types, cx, 4).asm["ptx"])

        tile = config.BWD_WS_SM90[d]
        kernel = bwd_ws_split.attn_bwd_ws_split_kernel if tile.split_d else bwd_ws.attn_bwd_ws_kernel
        parts = 2 if tile.split_d else 1
        types = dict(q_desc=descriptor_type(tile.block_m, d, torch.bfloat16),
                     do_desc=descriptor_type(tile.block_m, d, torch.bfloat16),
                     k_desc=descriptor_type(tile.block_n, d, torch.bfloat16),
                     v_desc=descriptor_type(tile.block_n, d, torch.bfloat16),
                     dq_desc=descriptor_type(tile.block_m, d, torch.float32, parts), Lse="*fp32", Delta="*fp32",
                     dK="*bf16", dV="*bf16", Sem="*i32", cu_seqlens_q="*i32", cu_seqlens_k="*i32", scale="fp32")
        cx = accepted(kernel, dict(
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, HEAD_D=d, NUM_STAGES=tile.num_stages,
            DQ_STAGES=tile.dq_stages, LOADER_REGS=tile.loader_regs, WRITER_REGS=tile.writer_regs,
            MMA_REGS=tile.mma_regs, DETERMINISTIC=deterministic, KEY_MAJOR=False, num_warps=tile.num_warps, **masked))
        options = {"maxnreg": tile.max_registers} if getattr(tile, "max_registers", 0) else {}
        out[f"{kernel.fn.__name__} d{d} causal={causal} varlen={varlen} det={deterministic}"] = strip_debug(
            compile_sm90(kernel, types, cx, tile.num_warps, **options).asm["ptx"])
    return out


def tree_dump(tree: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{tree / 'tests'}")
    run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--dump"], cwd=tree, env=env,
                         capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"compiling the kernels of {tree} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout)


def main():
    if sys.argv[1:] == ["--dump"]:
        print(json.dumps(dump()))
        return
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    old, new = tree_dump(Path(sys.argv[1]).resolve()), tree_dump(Path(__file__).resolve().parents[1])
    differ = 0
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            print(f"{name}: only in {'this tree' if name in new else 'OLD_TREE'}")
            differ += 1
            continue
        a, b = old[name].splitlines(), new[name].splitlines()
        changed = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
        print(f"{name}: " + ("IDENTICAL" if a == b else f"{changed} lines differ"), flush=True)
        differ += a != b
    print(f"{len(new) - differ} of {len(new)} variants identical")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
