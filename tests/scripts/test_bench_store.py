"""scripts/bench_store.py: one current result per benchmark key in bench/<gpu>.json; a newer run replaces its key."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_store.py"
spec = importlib.util.spec_from_file_location("bench_store", SCRIPT)
bench_store = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_store)

keys = st.text(alphabet="abcdefgh-", min_size=1, max_size=6)
results = st.dictionaries(st.text(alphabet="xyz", min_size=1, max_size=3), st.integers(), max_size=3)


@settings(max_examples=30, deadline=None)
@given(runs=st.lists(st.tuples(keys, results), min_size=1, max_size=6))
def test_the_last_run_of_each_key_is_the_one_kept(tmp_path_factory, runs):
    folder = tmp_path_factory.mktemp("bench")
    for number, (key, result) in enumerate(runs):
        raw = folder / f"run-{number}.json"
        raw.write_text(json.dumps(result))
        bench_store.store(raw, key, "gpu", folder)
    stored = json.loads((folder / "gpu.json").read_text())
    last = {key: (number, result) for number, (key, result) in enumerate(runs)}
    assert list(stored) == sorted(last)
    for key, (number, result) in last.items():
        assert stored[key] == {"source": f"run-{number}.json", "result": result}


def test_the_figure_becomes_the_gpus_one_figure(tmp_path):
    raw, figure = tmp_path / "grid.json", tmp_path / "grid.png"
    raw.write_text("{}")
    figure.write_bytes(b"\x89PNG figure")
    bench_store.main([str(raw), "--key", "grid", "--gpu", "gpu", "--figure", str(figure), "--bench", str(tmp_path)])
    assert (tmp_path / "gpu.png").read_bytes() == b"\x89PNG figure"
