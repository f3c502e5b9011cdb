"""scripts/host_cost.py's report (CPU): the ratios per row come from the rows' own numbers, skipped and
failed peers say so, and a run on the CPU (reference backend, peers skipped) writes every row."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "host_cost.py"
_spec = importlib.util.spec_from_file_location("host_cost", _SCRIPT)
host_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_cost)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(md: str, title: str) -> list[list[str]]:
    lines = md.split(f"## {title}")[1].split("\n## ")[0].splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    return [_cells(line) for line in rows[1:]]       # without the header


def _random_data(seed: int):
    rng = random.Random(seed)
    peers = list(host_cost.PEERS)

    def host_cell():
        roll = rng.random()
        if roll < 0.15:
            return dict(skipped="FA4 not importable")
        if roll < 0.25:
            return dict(error="RuntimeError: no kernel")
        host = rng.uniform(20, 2000)
        return dict(host_us=host, wall_us=host * rng.uniform(1.0, 2.0), gpu_bound=rng.random() < 0.3)

    host = [dict(call=call, b=1, s=128, h=16, d=128, causal=rng.random() < 0.5, layout=rng.choice(["dense", "varlen"]),
                 peers={n: host_cell() for n in peers}) for call in host_cost.CALLS for _ in range(3)]
    throughput = []
    for d in (64, 128):
        for s in (512, 1024):
            cells = {}
            for n in ("ours", "sdpa_cudnn", "fa4"):
                cells[n] = dict(skipped="no") if rng.random() < 0.2 else \
                    dict(fwd_tflops=rng.uniform(20, 700), bwd_tflops=rng.uniform(20, 600))
            throughput.append(dict(b=16384 // s, s=s, h=2048 // d, d=d, causal=rng.random() < 0.5, peers=cells))
    meta = dict(date="2026-12-01", gpu="NVIDIA H200", device="cuda:0", torch="2.13", triton="3.6", dtype="bfloat16",
                backend="auto", calls=200, repeats=5, peers=peers, throughput_peers=["ours", "sdpa_cudnn", "fa4"],
                skipped={"fa4": "FA4 not importable (ImportError: x)"})
    return dict(meta=meta, host=host, throughput=throughput)


@pytest.mark.parametrize("seed", range(5))
def test_report_ratios_per_row(tmp_path, seed):
    data = _random_data(seed)
    stem = tmp_path / "run"
    host_cost.write(stem, data)
    md = stem.with_suffix(".md").read_text()
    assert "FA4: FA4 not importable" in md
    host_table = _table(md, "Host µs per call")
    assert len(host_table) == len(data["host"])
    for cells, row in zip(host_table, data["host"]):
        assert cells[0] == host_cost.CALL_LABELS[row["call"]] and cells[6] == row["layout"]
        for cell, name in zip(cells[7:11], host_cost.PEERS):
            peer = row["peers"][name]
            if "host_us" in peer:
                assert float(cell.rstrip("*")) == pytest.approx(peer["host_us"], abs=0.51)
                assert cell.endswith("*") == peer["gpu_bound"]
            else:
                assert cell == ("skipped" if "skipped" in peer else "error")
        ours, fa2 = row["peers"]["ours"].get("host_us"), row["peers"]["sdpa_flash"].get("host_us")
        if ours and fa2:
            assert float(cells[11]) == pytest.approx(ours / fa2, abs=0.006)
        else:
            assert cells[11] == "-"
    for cells, row in zip(_table(md, "Throughput"), data["throughput"]):
        for direction, ratio_at in (("fwd", 8), ("bwd", 12)):
            ours = row["peers"]["ours"].get(f"{direction}_tflops")
            cudnn = row["peers"]["sdpa_cudnn"].get(f"{direction}_tflops")
            expected = f"{ours / cudnn:.2f}" if ours and cudnn else "-"
            assert cells[ratio_at] == expected
    assert json.loads(stem.with_suffix(".json").read_text()) == data
    if importlib.util.find_spec("matplotlib"):
        assert stem.with_suffix(".png").stat().st_size > 1000


def test_runs_on_cpu_with_reference_backend(tmp_path):
    stem = host_cost.main(["--device", "cpu", "--calls", "2", "--repeats", "1", "--host-shapes", "1:4:1:8",
                           "--seqs", "8", "--dims", "8", "--tokens", "16", "--hidden", "8", "--out", str(tmp_path)])
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["meta"]["backend"] == "reference"
    assert set(data["meta"]["skipped"]) == {"sdpa_flash", "sdpa_cudnn", "fa4"}
    # every call x causal x layout of the one shape, ours measured and every peer skipped with its reason
    kinds = {(r["call"], r["causal"], r["layout"]) for r in data["host"]}
    assert len(data["host"]) == len(kinds) == len(host_cost.CALLS) * 2 * 2
    for row in data["host"]:
        assert row["peers"]["ours"]["host_us"] > 0
        assert row["peers"]["ours"]["wall_us"] >= row["peers"]["ours"]["host_us"]
        assert all(row["peers"][n] == dict(skipped="needs CUDA") for n in ("sdpa_flash", "sdpa_cudnn", "fa4"))
    assert [(r["d"], r["s"], r["causal"]) for r in data["throughput"]] == [(8, 8, False), (8, 8, True)]
    for row in data["throughput"]:
        cell = row["peers"]["ours"]
        expected = host_cost.flops(row["b"], row["h"], 8, 8, row["causal"], True) / (cell["bwd_ms"] * 1e-3) / 1e12
        assert cell["bwd_tflops"] == pytest.approx(expected)


@pytest.mark.parametrize("keep", ["host", "throughput", "layers"])
def test_a_report_has_the_sections_of_its_rows_only(tmp_path, keep):
    """A run with --no-host, --no-throughput or --layers alone writes no empty table (and no empty plot)."""
    data = _random_data(0)
    layers = [dict(layer="fwd: flash_attn_func, no grad", layout=layout, host_us=50.0)
              for layout in ("dense", "varlen")]
    data["meta"].update(layer_shape="1:128:16:128", layer_backend="triton")
    data = dict(meta=data["meta"], host=data["host"] if keep == "host" else [],
                throughput=data["throughput"] if keep == "throughput" else [],
                layers=layers if keep == "layers" else [])
    host_cost.write(tmp_path / "run", data)
    md = (tmp_path / "run.md").read_text()
    titles = {"host": "## Host µs per call\n", "throughput": "## Throughput", "layers": "## Host µs per call of each"}
    assert [name for name, title in titles.items() if title in md] == [keep]
    assert (tmp_path / "run.png").exists() == (keep != "layers")
