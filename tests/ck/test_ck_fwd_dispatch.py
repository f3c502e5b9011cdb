"""Which forward instance CK's generated `fmha_fwd` dispatcher launches for a call, without a GPU.

The glue (`csrc_ck/src/fwd.cpp`) fills `fmha_fwd_traits` / `fmha_fwd_args` and calls CK's generated
`fmha_fwd`; the generated `fmha_fwd_api.cpp` decides the instance by a chain of conditions on the
device name, the traits and a few argument fields. Here that generated C++ is translated line by
line into Python (its conditions only use comparisons, `%`, `&&`/`||` and string compares) and run
with the traits and arguments the glue sets, once over the full gfx942 instance set (what an MI300
build dispatches) and once over the CI compile check's set (`--minimal`): the featureful forward
call must reach, in the full set, exactly the instance the compile check builds.

Skipped without the CK tree (`python3 scripts/ck_fetch.py`; `scripts/ck_compile_check.sh` fetches it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CK = REPO / ".ck" / "composable_kernel"
pytestmark = pytest.mark.skipif(not (CK / "example/ck_tile/01_fmha/generate.py").is_file(),
                                reason=f"no CK tree at {CK} (scripts/ck_fetch.py)")

# The compile check's featureful forward instance (scripts/ck_generate.py, "minimal").
FEATUREFUL_FWD = ("fmha_fwd_d256_bf16_group_b128x128x32x256x32x256_r4x1x1_r4x1x1_w32x32x16_w32x32x16_qr_vr_psskddv_"
                  "nlogits_alibi_mask_lse_dropout_nskip_nsquant_ntrload")
TRAIT_OF_FEATUREFUL = ("fmha_fwd_traits_<256, FmhaFwdBf16, true, 128, 128, 32, 256, 32, 256, true, "
                       "ck_tile::BlockFmhaPipelineEnum::QRKSVS, false, "
                       "ck_tile::SimplifiedGenericAttentionMask<true>, ck_tile::BlockAttentionBiasEnum::ALIBI, "
                       "true, true, false, true, true, true, true, false, false>")


def dispatcher(api_cpp: str):
    """The body of CK's generated `fmha_fwd` as a Python function (t, a, device_name) -> trait or None."""
    body = api_cpp[api_cpp.index("const std::string device_name"):]
    body = body[body.index("\n") + 1:]
    lines, depth, pending = ["def fmha_fwd(t, a, device_name):"], 1, ""
    for raw in body.splitlines():
        line = pending + " " + raw.strip() if pending else raw.strip()
        if not line or line.startswith("//"):
            continue
        if re.match(r"(else )?if\(", line) and not line.endswith(") {"):
            pending = line       # a condition continued on the next line
            continue
        pending = ""
        if m := re.fullmatch(r"(else )?if\((.*)\) \{", line):
            lines.append("    " * depth + ("elif " if m[1] else "if ") + condition(m[2]) + ":")
            lines.append("    " * (depth + 1) + "pass")
            depth += 1
        elif line == "}":
            depth -= 1
        elif m := re.fullmatch(r"using trait_ = (.*);", line):
            lines.append("    " * depth + f"trait = {m[1]!r}")
        elif line.startswith("return fmha_fwd_<trait_"):
            lines.append("    " * depth + "return trait")
        elif line == "return r;":
            lines.append("    " * depth + "return None")
            break
        else:
            raise AssertionError(f"unexpected line in fmha_fwd_api.cpp: {line!r}")
    scope: dict = {}
    exec("\n".join(lines), scope)  # our translation of CK's generated dispatcher
    return scope["fmha_fwd"]


def condition(c: str) -> str:
    c = re.sub(r"/\*.*?\*/", "", c)
    c = re.sub(r'device_name\.compare\(0, (\d+), "(\w+)"\) == 0', r'device_name.startswith("\2")', c)
    c = re.sub(r't\.data_type\.compare\("(\w+)"\) == 0', r't.data_type == "\1"', c)
    c = re.sub(r"(mask|bias)_enum::(\w+)", r'"\2"', c)
    c = c.replace("nullptr", "None").replace("&&", " and ").replace("||", " or ")
    c = re.sub(r"\btrue\b", "True", re.sub(r"\bfalse\b", "False", c))
    c = re.sub(r"(\w+(?:\.\w+)?) (!=|==) None", lambda m: f"{m[1]} {'is not' if m[2] == '!=' else 'is'} None", c)
    assert "::" not in c and "(" + ")" not in c, c
    return c


class Fields(dict):
    __getattr__ = dict.__getitem__


def glue_call(d: int, *, group: bool, mask: str, alibi: bool, dropout: bool, dtype: str = "bf16"):
    """fmha_fwd_traits / fmha_fwd_args fields as csrc_ck/src/fwd.cpp and glue.hpp set them."""
    t = Fields(hdim_q=d, hdim_v=d, data_type=dtype, is_group_mode=group, is_v_rowmajor=True,
               has_logits_soft_cap=False, mask_type=mask, bias_type="alibi" if alibi else "no_bias",
               has_lse=True, has_dropout=dropout, do_fp8_static_quant=False, skip_min_seqlen_q=False)
    a = Fields(hdim_q=d, hdim_v=d, seqlen_q=100, seqlen_k=300, max_seqlen_q=100, batch=3, nhead_q=4,
               cu_seqlen_k_ptr=None)   # fmha_fwd_args is value-initialised; the glue never sets it
    return t, a


@pytest.fixture(scope="module")
def apis(tmp_path_factory):
    sys.path.insert(0, str(REPO / "scripts"))
    import ck_generate

    out = {}
    for selection in ("full", "minimal"):
        folder = tmp_path_factory.mktemp(selection)
        ck_generate.generate(CK, folder, ["gfx942"], selection)
        out[selection] = dispatcher((folder / "fmha_fwd_api.cpp").read_text())
    out["minimal_names"] = sorted(p.name for p in folder.glob("fmha_fwd_d*.cpp"))
    return out


def test_translation_matches_known_branches(apis):
    # Plain fp16 d128 batch call: the compile check's plain forward instance in both sets.
    t, a = glue_call(128, group=False, mask="no_mask", alibi=False, dropout=False, dtype="fp16")
    assert apis["full"](t, a, "gfx942") == apis["minimal"](t, a, "gfx942") is not None
    # Not gfx9 (the set is generated for gfx942 only): nothing.
    assert apis["full"](t, a, "gfx1100") is None
    # Softcap has no instance in our selection.
    assert apis["full"](Fields(t, has_logits_soft_cap=True), a, "gfx942") is None


@pytest.mark.parametrize("d", [200, 232, 248])
@pytest.mark.parametrize("mask", ["window_generic", "mask_top_left", "mask_bottom_right"])
def test_featureful_forward_call_reaches_the_compiled_instance(apis, d, mask):
    """bf16, group mode, a mask, ALiBi, dropout, lse, a head dim padded inside the d256 bucket."""
    assert f"{FEATUREFUL_FWD}_gfx9.cpp" in apis["minimal_names"]
    t, a = glue_call(d, group=True, mask=mask, alibi=True, dropout=True)
    full = apis["full"](t, a, "gfx942")
    assert full == TRAIT_OF_FEATUREFUL          # what an MI300 build launches (qr pipeline, psskddv)
    assert apis["minimal"](t, a, "gfx942") == full  # ... is what CI compiles


def test_featureful_forward_d72_uses_the_async_pipeline(apis):
    """d = 72 (d96 bucket) reaches a qr_async instance on an MI300 build: the kind Debian's clang-19 cannot
    assemble. The CI set has no d96 forward bucket, so there the same call falls to the d256 instance."""
    t, a = glue_call(72, group=True, mask="window_generic", alibi=True, dropout=True)
    trait = apis["full"](t, a, "gfx942")
    assert trait.startswith("fmha_fwd_traits_<96, FmhaFwdBf16, true,") and "QRKSVS_ASYNC" in trait
    assert apis["minimal"](t, a, "gfx942") == TRAIT_OF_FEATUREFUL
