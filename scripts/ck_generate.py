#!/usr/bin/env python3
"""Generate the CK fmha instances our dispatcher can reach, with CK's own generator.

Runs CK's `example/ck_tile/01_fmha/generate.py` machinery for `fwd` and `bwd` with the
flash-attention receipt (2: fp16/bf16, no bias or ALiBi, with and without dropout, both
deterministic variants), then narrows it with a predicate on the kernel names, because CK's
`-f` filter is a single fnmatch pattern and cannot exclude:

  * backward `pd1dv1` instances (any head dim): our frontend pads d to a multiple of 8, so
    only the unpadded and the 8-padded variants are reachable;
  * forward instances with logits softcap (we refuse softcap) or without lse (always stored).

The forward's d192/dv128 tiles stay: q/k and v may have head dims of their own (d = 192, d_v = 128 is
DeepSeek-style MLA's).

The predicate is installed where CK's codegen calls `fnmatch.fnmatch(kernel_name, filter)`, so
both the instance files and the API dispatchers (fmha_*_api.cpp) contain exactly the selection.
`--minimal` keeps two forward and two backward instances (fp16 d128 batch mode without mask/bias/
dropout; and bf16 group mode with mask, ALiBi, dropout: forward d256/psskddv on the `qr` pipeline,
backward d96/pd8 deterministic): the CI compile check.

Besides CK's files it writes `fack_head_dims_api.cpp`: the (hdim_q, hdim_v) buckets of the instances it
generated, which the library exports as `fack_fwd_head_dims` / `fack_bwd_head_dims` (the backend refuses a call
whose head dims no bucket holds, in words, before any launch); and `fack_bwd_tile_api.cpp`: CK's own backward
dispatcher, generated from the same instance list by CK's code generator, with each branch returning the
instance's key tile (`bn0`, the kN0 that sizes deterministic dq_accum) instead of launching it. The library
exports it as `fack_bwd_tile`, so the frontend plans with the tile of the instance that will run.

Usage: ck_generate.py --ck CK_ROOT --out DIR [--targets gfx942[,gfx90a,gfx950]] [--minimal]
Prints the generated .cpp files, one a line, heaviest first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

FMHA_EXAMPLE = Path("example/ck_tile/01_fmha")
RECEIPT_FLASH_ATTENTION = 2

# Kernel-name rules, by kind of kernel; the name tokens are CK's (codegen/ops/fmha_{fwd,bwd}.py).
# "bwd_aux" are the dot_do_o and convert_dq kernels that CK pairs with each dq_dk_dv kernel.
# A forward instance's head dims: `fmha_fwd_d{hdim_q}_..._b{bm0}x{bn0}x{bk0}x{bn1}x{bk1}x{bk0max}`, bn1 = hdim_v.
FWD_HEAD_DIMS = re.compile(r"^fmha_fwd_d(\d+)_.*?_b\d+x\d+x\d+x(\d+)x\d+x\d+(_|$)")
# A dq_dk_dv instance's bucket holds both head dims (CK: `t.hdim_q <= hdim && t.hdim_v <= hdim`).
BWD_HEAD_DIM = re.compile(r"^fmha_bwd_d(\d+)_")


def has(name: str, *tokens: str) -> bool:
    """Every token appears as a whole `_`-separated part of the name."""
    return all(re.search(rf"_{token}(_|$)", name) for token in tokens)


RULES = {
    "full": {
        "fwd": lambda n: has(n, "nlogits", "lse"),
        "dq_dk_dv": lambda n: not has(n, "pd1dv1"),
        "bwd_aux": lambda n: True,
    },
    # The CI compile check: two forward and two backward instances. Forward: the plain one (fp16, d128,
    # batch mode, no mask/bias/dropout) and a featureful one: bf16, group mode, a mask (causal or
    # window), ALiBi, dropout, lse, in the d256 bucket with the padded head dim (`psskddv`) that any d in
    # (192, 256) reaches, without min-seqlen skipping (the glue sets skip_min_seqlen_q = false). CK
    # builds that bucket with the `qr` pipeline; every smaller bucket uses `qr_async`, whose group-mode
    # instances do not assemble with Debian's clang-19 ("invalid operand for instruction": the buffer
    # resource of the async pipeline's inline `buffer_load_dword ... lds` lands in VGPRs), see
    # docs/ck.md. Backward: the plain one (same features, not deterministic) and a featureful one: bf16,
    # group mode, a mask, ALiBi, dropout, deterministic, in the d96 bucket with the 8-padded head dim
    # that d = 72 reaches. Sequence-padded variants only.
    "minimal": {
        "fwd": lambda n: (has(n, "d128", "fp16", "batch", "psskddv", "nlogits", "nbias", "nmask", "lse", "ndropout")
                          or has(n, "d256", "bf16", "group", "qr", "psskddv", "nlogits", "alibi", "mask", "lse",
                                 "dropout", "nskip")),
        "dq_dk_dv": lambda n: (has(n, "d128", "fp16", "batch", "npad", "nbias", "nmask", "ndropout", "ndeterministic")
                               or has(n, "d96", "bf16", "group", "pd8dv8", "alibi", "mask", "dropout",
                                      "deterministic")),
        "bwd_aux": lambda n: (has(n, "d128", "fp16", "batch", "ps")
                              or (has(n, "d96", "bf16", "group") and (has(n, "psd") or has(n, "psdv")))),
    },
}
KINDS = {  # name prefix -> kind, most specific first
    "fmha_bwd_dot_do_o_": "bwd_aux",
    "fmha_bwd_convert_dq_": "bwd_aux",
    "fmha_bwd_d": "dq_dk_dv",
    "fmha_fwd_d": "fwd",
}


def kind_of(name: str) -> str:
    return next(kind for prefix, kind in KINDS.items() if name.startswith(prefix))


def kernel_predicate(rules: dict):
    """CK calls its filter with each kernel's name (for the backward: the dq_dk_dv, dot_do_o and
    convert_dq names of one dispatch entry, which is kept only if all three pass)."""
    return lambda name, _pattern: rules[kind_of(name)](name)


@contextlib.contextmanager
def inside(folder: Path):
    previous = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def generate(ck_root: Path, out: Path, targets: list[str], selection: str) -> list[Path]:
    example = (ck_root / FMHA_EXAMPLE).resolve()
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("fmha_*.cpp"):
        old.unlink()        # a narrower selection must not leave stale instances behind
    sys.path.insert(0, str(example))
    with inside(example):
        import generate as ck_generate  # CK's generate.py: registers its codegen ops on import
    ops = {op.__name__.removeprefix("fmha_"): op for op in ck_generate.ops}
    for api in ("bwd", "fwd"):
        # The filter pattern is non-empty so CK consults it; our predicate ignores its text.
        ops[api].fnmatch = SimpleNamespace(fnmatch=kernel_predicate(RULES[selection]))
        ck_generate.write_blobs(targets, str(out), [api], ["*"], [-1], RECEIPT_FLASH_ATTENTION, "simplified")
    write_tile_api(ops["bwd"], targets, out)
    instances = sorted(out.glob("fmha_*.cpp"), key=build_order)
    write_head_dims_api(instances, out)
    return [*instances, out / HEAD_DIMS_API, out / TILE_API]


HEAD_DIMS_API = "fack_head_dims_api.cpp"
HEAD_DIMS_API_TEXT = """// Generated by scripts/ck_generate.py: the (hdim_q, hdim_v) buckets of the instances compiled
// into this library (flash_attn_ck.h, fack_fwd_head_dims / fack_bwd_head_dims).
#include "flash_attn_ck.h"

extern "C" const char* fack_fwd_head_dims(void) {{ return "{fwd}"; }}

extern "C" const char* fack_bwd_head_dims(void) {{ return "{bwd}"; }}
"""


def head_dim_buckets(instances: list[Path]) -> dict[str, list[tuple[int, int]]]:
    """The (hdim_q, hdim_v) buckets of the forward and dq_dk_dv instances, by kind, ascending."""
    buckets: dict[str, set[tuple[int, int]]] = {"fwd": set(), "bwd": set()}
    for path in instances:
        if (fwd := FWD_HEAD_DIMS.match(path.name)) is not None:
            buckets["fwd"].add((int(fwd.group(1)), int(fwd.group(2))))
        elif (bwd := BWD_HEAD_DIM.match(path.name)) is not None:       # dq_dk_dv, not dot_do_o or convert_dq
            buckets["bwd"].add((int(bwd.group(1)), int(bwd.group(1))))
    return {kind: sorted(pairs) for kind, pairs in buckets.items()}


def write_head_dims_api(instances: list[Path], out: Path) -> None:
    text = {kind: ",".join(f"{q}x{v}" for q, v in pairs) for kind, pairs in head_dim_buckets(instances).items()}
    (out / HEAD_DIMS_API).write_text(HEAD_DIMS_API_TEXT.format(**text))


TILE_API = "fack_bwd_tile_api.cpp"
TILE_API_FUNCTION = """
namespace fack_detail {{
// Generated by scripts/ck_generate.py from CK's fmha_bwd dispatcher: the same conditions, in the
// same order, over the same instances; each branch returns its dq_dk_dv instance's bn0 (kN0).
int bwd_tile_kn0(const fmha_bwd_traits& t, const fmha_bwd_args& a, const std::string& device_name)
{{
    (void)t; (void)a; (void)device_name;
    int r = -1;
{F_dispatch}
    return r;
}}
}} // namespace fack_detail
"""


def write_tile_api(bwd, targets: list[str], out: Path) -> None:
    """CK's backward API dispatcher with each launch replaced by `return bn0`: the one source of kN0."""
    inner = bwd.FMHA_BWD_API_INNER_DISPATCH
    condition = inner[:inner.index(") {{\n") + len(") {{\n")]
    saved = bwd.FMHA_BWD_API, bwd.FMHA_BWD_API_INNER_DISPATCH
    bwd.FMHA_BWD_API = TILE_API_FUNCTION
    bwd.FMHA_BWD_API_INNER_DISPATCH = condition + "    r = {F_bn0};\n    return r;\n}}\n"
    try:
        pool = bwd.get_bwd_blobs(targets, "*", RECEIPT_FLASH_ATTENTION, "simplified", [-1])[0]
        text = pool.api
    finally:
        bwd.FMHA_BWD_API, bwd.FMHA_BWD_API_INNER_DISPATCH = saved
    (out / TILE_API).write_text(text)


def build_order(path: Path) -> tuple[int, str]:
    """Heaviest first, so parallel builds finish together: dq_dk_dv, fwd, dot_do_o/convert_dq, APIs."""
    if path.name.endswith("_api.cpp") or path.name in (TILE_API, HEAD_DIMS_API):
        return 3, path.name
    return {"dq_dk_dv": 0, "fwd": 1, "bwd_aux": 2}[kind_of(path.name)], path.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ck", type=Path, required=True, help="CK root (the folder holding example/ and include/)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--targets", default="gfx942", help="comma-separated: gfx942, gfx90a, gfx950")
    parser.add_argument("--minimal", action="store_true", help="one fwd and one bwd instance (CI compile check)")
    args = parser.parse_args()
    files = generate(args.ck, args.out, args.targets.split(","), "minimal" if args.minimal else "full")
    for f in files:
        print(f)
    counts = {kind: sum(f.name.startswith(prefix) for f in files) for prefix, kind in
              (("fmha_fwd_d", "fwd"), ("fmha_bwd_dot_do_o_", "dot_do_o"), ("fmha_bwd_convert_dq_", "convert_dq"))}
    counts["dq_dk_dv"] = sum(re.match(r"fmha_bwd_d\d", f.name) is not None for f in files)
    counts["api"] = sum(f.name.endswith("_api.cpp") for f in files)
    print(f"{len(files)} files: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
