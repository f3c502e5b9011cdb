#!/usr/bin/env python3
"""Make Debian 12's HIP 5.2 toolchain usable for CK on gfx942, in a private folder.

Debian ships HIP 5.2 headers and device libraries; two gaps stop a gfx942 build of CK:

1. The device libraries stop at gfx940. The only per-ISA difference is the constant in
   `oclc_isa_version_<isa>.bc`, so gfx942's is made from gfx940's (9400 -> 9402), next to links
   to every other bitcode file; pass the folder with `--rocm-device-lib-path`.
2. `amd_hip_vector_types.h` gives `HIP_vector_base` user-written copy assignments, which makes the
   vector types non-trivially-copyable and breaks `__builtin_bit_cast` in CK's dropout code. A
   patched copy with those assignments defaulted goes into an include overlay, first on the path.

Nothing AMD is committed: both are derived from the installed packages at build time.
Usage: ck_debian_overlay.py OUT_DIR  (prints the two folders to use)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

BITCODE_DIR = Path("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode")
VECTOR_TYPES = Path("/usr/include/hip/amd_detail/amd_hip_vector_types.h")

# A user-written `HIP_vector_base& operator=(const HIP_vector_base& x_) noexcept { ... }`:
# the body ends at the first closing brace at the function's own indentation.
USER_COPY_ASSIGN = re.compile(
    r"^(?P<indent>[ \t]*)HIP_vector_base& operator=\(const HIP_vector_base& x_\) noexcept \{\n"
    r".*?^(?P=indent)\}\n",
    re.MULTILINE | re.DOTALL,
)
EXPECTED_ASSIGNMENTS = 3   # the 1-, 2- and 3-element specialisations


def isa_constant(isa: str) -> int:
    """gfx<major><minor><stepping> -> major * 1000 + minor * 100 + stepping (gfx942 -> 9402)."""
    major, minor, stepping = isa[:-2], isa[-2], isa[-1]
    return int(major) * 1000 + int(minor, 16) * 100 + int(stepping, 16)


def make_bitcode_overlay(out: Path, isa_from: str = "940", isa_to: str = "942") -> Path:
    folder = out / "bitcode"
    folder.mkdir(parents=True, exist_ok=True)
    for bc in BITCODE_DIR.glob("*.bc"):
        link = folder / bc.name
        if not link.exists():
            link.symlink_to(bc)
    source = BITCODE_DIR / f"oclc_isa_version_{isa_from}.bc"
    text = subprocess.run(["llvm-dis-19", "-o", "-", str(source)], check=True,
                          capture_output=True, text=True).stdout
    constant = re.compile(rf"(@__oclc_ISA_version = .* i32 ){isa_constant(isa_from)}\b")
    patched, count = constant.subn(rf"\g<1>{isa_constant(isa_to)}", text)
    if count != 1:
        sys.exit(f"{source}: expected one __oclc_ISA_version = {isa_constant(isa_from)}, found {count}")
    target = folder / f"oclc_isa_version_{isa_to}.bc"
    target.unlink(missing_ok=True)
    subprocess.run(["llvm-as-19", "-o", str(target), "-"], input=patched, check=True, text=True)
    return folder


def make_include_overlay(out: Path) -> Path:
    folder = out / "include"
    header = folder / "hip" / "amd_detail" / VECTOR_TYPES.name
    header.parent.mkdir(parents=True, exist_ok=True)
    text = VECTOR_TYPES.read_text()
    patched, count = USER_COPY_ASSIGN.subn(
        lambda m: f"{m['indent']}HIP_vector_base& operator=(const HIP_vector_base&) = default;\n", text)
    if count != EXPECTED_ASSIGNMENTS:
        sys.exit(f"{VECTOR_TYPES}: expected {EXPECTED_ASSIGNMENTS} user-written copy assignments, found {count}")
    header.write_text(patched)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(make_bitcode_overlay(args.out))
    print(make_include_overlay(args.out))


if __name__ == "__main__":
    main()
