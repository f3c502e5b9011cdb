"""The ctypes mirror in backends/ck.py against the C header, as the system C compiler lays it out.

A small program is generated from the ctypes field lists: it prints offsetof and sizeof of every
field (nested ones by their dotted path), sizeof/alignment of every struct, and the header's
constants. Any field added, removed, reordered or retyped on one side only shows up here.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from flash_attn_ck.backends.ck import backend as ck
from flash_attn_ck.core.mask import MaskType

HEADER_DIR = Path(__file__).resolve().parents[2] / "csrc_ck" / "include"

C_NAMES = {
    ck.FackTensor: "fack_tensor",
    ck.FackRowStats: "fack_row_stats",
    ck.FackAttention: "fack_attention",
    ck.FackBwdArgs: "fack_bwd_args",
}

CONSTANTS = {
    "FACK_ABI_VERSION": ck.ABI_VERSION,
    "FACK_OK": 0,
    "FACK_HIP_ERROR": ck.FACK_HIP_ERROR,
    "FACK_FP16": ck.DTYPES[torch.float16],
    "FACK_BF16": ck.DTYPES[torch.bfloat16],
    "FACK_MASK_NONE": MaskType.NO_MASK,
    "FACK_MASK_TOP_LEFT": MaskType.TOP_LEFT,
    "FACK_MASK_BOTTOM_RIGHT": MaskType.BOTTOM_RIGHT,
    "FACK_MASK_WINDOW_GENERIC": MaskType.WINDOW_GENERIC,
}


def ctypes_layout(struct: type[ctypes.Structure], prefix: str = "", base: int = 0) -> dict[str, tuple[int, int]]:
    """Dotted field path -> (offset, size), descending into nested structs."""
    layout = {}
    for name, ftype in struct._fields_:
        offset = base + getattr(struct, name).offset
        path = prefix + name
        layout[path] = (offset, ctypes.sizeof(ftype))
        if issubclass(ftype, ctypes.Structure):
            layout.update(ctypes_layout(ftype, path + ".", offset))
    return layout


def expected_report() -> dict[str, int]:
    report = {}
    for struct, c_name in C_NAMES.items():
        report[f"sizeof {c_name}"] = ctypes.sizeof(struct)
        report[f"alignof {c_name}"] = ctypes.alignment(struct)
        for path, (offset, size) in ctypes_layout(struct).items():
            report[f"offsetof {c_name}.{path}"] = offset
            report[f"sizeof {c_name}.{path}"] = size
    report.update({f"value {name}": int(value) for name, value in CONSTANTS.items()})
    return report


def layout_program() -> str:
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "flash_attn_ck.h"',
             "#ifdef __cplusplus", "#define ALIGNOF alignof", "#else", "#define ALIGNOF _Alignof", "#endif",
             "int main(void) {"]

    def emit(label: str, expr: str) -> None:
        lines.append(f'    printf("%s %lld\\n", "{label}", (long long)({expr}));')

    for struct, c_name in C_NAMES.items():
        emit(f"sizeof {c_name}", f"sizeof({c_name})")
        emit(f"alignof {c_name}", f"ALIGNOF({c_name})")
        for path in ctypes_layout(struct):
            emit(f"offsetof {c_name}.{path}", f"offsetof({c_name}, {path})")
            emit(f"sizeof {c_name}.{path}", f"sizeof((({c_name} *)0)->{path})")
    for name in CONSTANTS:
        emit(f"value {name}", name)
    lines += ["    return 0;", "}"]
    return "\n".join(lines) + "\n"


def compile_and_run(compiler: str, language_flags: list[str], tmp_path: Path) -> dict[str, int]:
    source = tmp_path / "layout.c"
    source.write_text(layout_program())
    binary = tmp_path / "layout"
    subprocess.run([compiler, *language_flags, "-Wall", "-Wextra", "-Werror", f"-I{HEADER_DIR}",
                    str(source), "-o", str(binary)], check=True, capture_output=True, text=True)
    output = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    report = {}
    for line in output.splitlines():
        label, value = line.rsplit(" ", 1)
        report[label] = int(value)
    return report


COMPILERS = [
    pytest.param("cc", ["-std=c11", "-pedantic"], id="c11"),
    # Compiled as C++ too: the glue includes the header from C++ (extern "C", no C-only constructs).
    # offsetof on a nested member is conditionally supported in C++: GCC and Clang accept it.
    pytest.param("c++", ["-x", "c++", "-std=c++17", "-Wno-invalid-offsetof"], id="c++17"),
]


@pytest.mark.parametrize("compiler,flags", COMPILERS)
def test_ctypes_structs_match_the_header(compiler, flags, tmp_path):
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler} on this machine")
    actual = compile_and_run(compiler, flags, tmp_path)
    expected = expected_report()
    mismatches = [f"{label}: C {actual.get(label)} vs ctypes {value}"
                  for label, value in expected.items() if actual.get(label) != value]
    assert not mismatches, "\n".join(mismatches)
    assert set(actual) == set(expected)


def test_every_header_field_is_mirrored():
    """Field names declared in the header, in order, equal the ctypes field names."""
    header = (HEADER_DIR / "flash_attn_ck.h").read_text()
    for struct, c_name in C_NAMES.items():
        body = header.split(f"typedef struct {c_name} {{", 1)[1].split(f"}} {c_name};", 1)[0]
        declared = [line.split("/*")[0].strip().rstrip(";").split()[-1].lstrip("*")
                    for line in body.splitlines() if line.split("/*")[0].strip()]
        assert declared == [name for name, _ in struct._fields_], c_name
