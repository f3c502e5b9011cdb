"""scripts/cp_bench.py's report (CPU): the scaling table's speed-ups and memory ratios come from the rows,
a sequence that does not fit one GPU says so, and the plot is written beside the JSON."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cp_bench.py"
_spec = importlib.util.spec_from_file_location("cp_bench", _SCRIPT)
cp_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp_bench)


def rows(seed):
    rng = random.Random(seed)
    out = []
    for seq in (32768, 65536, 131072):
        for exchange in ("ring", "allgather"):
            ms, single = rng.uniform(5, 50), rng.choice([None, rng.uniform(10, 100)])
            out.append(dict(seqlen=seq, world=2, kv_exchange=exchange, ms=ms, peak_gib=rng.uniform(1, 9),
                            single_ms=single, single_peak_gib=rng.uniform(2, 18) if single else None,
                            speedup=single / ms if single else None))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_scaling_table_and_plot(tmp_path, seed):
    data = rows(seed)
    path = tmp_path / "cp.json"
    path.write_text(json.dumps(data))
    cp_bench.report(data, str(path))
    table = (tmp_path / "cp.md").read_text().splitlines()[2:]
    assert len(table) == len(data)
    for line, r in zip(table, data):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:3] == [str(r["seqlen"]), r["kv_exchange"], "2"]
        assert float(cells[3]) == pytest.approx(r["ms"], abs=0.006)
        if r["single_ms"]:
            assert float(cells[5].rstrip("x")) == pytest.approx(r["single_ms"] / r["ms"], abs=0.006)
            assert float(cells[8]) == pytest.approx(r["peak_gib"] / r["single_peak_gib"], abs=0.006)
        else:
            assert cells[4] == "does not fit" and cells[5] == "-"
    assert (tmp_path / "cp.png").stat().st_size > 1000
