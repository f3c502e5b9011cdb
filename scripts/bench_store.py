"""Keep one current result file per GPU: fold a benchmark's raw output into ``bench/<gpu>.json``.

Each benchmark script writes its own json (and md/png) under ``$OUT``. What is committed is one file per GPU,
``bench/<gpu>.json``, holding the current result of each benchmark under its key (``grid``, ``host-cost``,
``workloads``, ...), with where it came from; a newer run of a benchmark replaces its key, and the run it replaces
stays in git history. ``--figure`` makes a run's figure the GPU's one figure (``bench/<gpu>.png``).

    python scripts/bench_store.py OUT/nvidia-h200-2026-12-03-grid.json --key grid --gpu nvidia-h200 \
        --figure OUT/nvidia-h200-2026-12-03-grid.png
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def store(result: Path, key: str, gpu: str, bench: Path = BENCH) -> Path:
    """Put ``result``'s json under ``key`` of ``bench/<gpu>.json`` (created when missing) and return that path."""
    target = bench / f"{gpu}.json"
    current = json.loads(target.read_text()) if target.exists() else {}
    current[key] = {"source": result.name, "result": json.loads(result.read_text())}
    target.write_text(json.dumps(dict(sorted(current.items())), indent=1) + "\n")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a benchmark's json output")
    parser.add_argument("--key", required=True, help="which benchmark it is (replaces that key's current result)")
    parser.add_argument("--gpu", required=True, help="the GPU's file name, e.g. nvidia-h200")
    parser.add_argument("--figure", type=Path, help="a png to keep as bench/<gpu>.png")
    parser.add_argument("--bench", type=Path, default=BENCH, help="the folder (default: the repository's bench/)")
    args = parser.parse_args(argv)
    print(store(args.result, args.key, args.gpu, args.bench))
    if args.figure is not None:
        shutil.copyfile(args.figure, args.bench / f"{args.gpu}.png")


if __name__ == "__main__":
    main()
