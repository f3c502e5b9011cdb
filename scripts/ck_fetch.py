#!/usr/bin/env python3
"""Fetch the pinned Composable Kernel tree into an ignored folder (default .ck/composable_kernel).

The CK we build against is the one vendored in the PyPI wheel amd-aiter==0.1.7.post2.dev18
(`aiter_meta/3rdparty/composable_kernel/`). The wheel is fetched with `pip download --no-deps`
and only the CK subtree is unpacked; nothing of it is committed. Prints the CK root.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

AITER_WHEEL = "amd-aiter==0.1.7.post2.dev18"
CK_PREFIX = "aiter_meta/3rdparty/composable_kernel/"
REPO = Path(__file__).resolve().parents[1]


def fetch(dest: Path, wheel_dir: Path) -> Path:
    stamp = dest / ".fetched-from"
    if stamp.is_file() and stamp.read_text().strip() == AITER_WHEEL:
        return dest
    wheels = sorted(wheel_dir.glob("amd_aiter-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheel_dir),
                        AITER_WHEEL], check=True)
        wheels = sorted(wheel_dir.glob("amd_aiter-*.whl"))
    if dest.exists():
        shutil.rmtree(dest)
    with zipfile.ZipFile(wheels[-1]) as wheel:
        members = [m for m in wheel.infolist() if m.filename.startswith(CK_PREFIX) and not m.is_dir()]
        if not members:
            sys.exit(f"{wheels[-1].name} holds no {CK_PREFIX}")
        for member in members:
            target = dest / member.filename[len(CK_PREFIX):]
            target.parent.mkdir(parents=True, exist_ok=True)
            with wheel.open(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
    stamp.write_text(AITER_WHEEL + "\n")
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".ck" / "composable_kernel")
    parser.add_argument("--wheel-dir", type=Path, default=REPO / ".ck" / "wheel")
    args = parser.parse_args()
    print(fetch(args.dest, args.wheel_dir))


if __name__ == "__main__":
    main()
