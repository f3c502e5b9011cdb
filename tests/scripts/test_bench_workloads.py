"""scripts/bench_workloads.py on CPU: the FLOP count (attended pairs), the document-length generator, the runners'
masks and the report of a run with the reference backend at tiny sizes (peers skipped)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_bwd
import bench_workloads as bw

from flash_attn_ck.core.mask import MaskInfo


def mask_pairs(s_q: int, s_k: int, causal: bool, window: int | None) -> int:
    """The pairs the project's mask keeps for the window the runners pass (left window, right 0 under causal)."""
    window_size = (-1 if window is None else window, 0 if causal else -1)
    mask = MaskInfo.from_flash_args(causal, window_size, s_q, s_k)
    return int(mask.keep(torch.arange(s_q), torch.arange(s_k)).sum()) if mask.is_masked else s_q * s_k


@settings(max_examples=200, deadline=None)
@given(s_q=st.integers(1, 48), s_k=st.integers(1, 48), causal=st.booleans(),
       window=st.none() | st.integers(0, 60))
def test_attended_pairs_are_the_pairs_the_mask_keeps(s_q, s_k, causal, window):
    assert bw.attended_pairs(s_q, s_k, causal, window) == mask_pairs(s_q, s_k, causal, window)


@settings(max_examples=100, deadline=None)
@given(total=st.integers(1, 40_000), median=st.integers(1, 500), longest=st.integers(1, 9000), seed=st.integers(0, 99))
def test_document_lengths_fill_the_pack_within_bounds(total, median, longest, seed):
    lengths = bw.document_lengths(total, median, longest, seed)
    assert sum(lengths) == total
    assert all(1 <= n <= longest for n in lengths)
    assert bw.document_lengths(total, median, longest, seed) == lengths     # seeded


def test_document_lengths_are_long_tailed_around_the_median():
    lengths = bw.document_lengths(3_000_000, 300, 8192, seed=1)
    assert 270 <= statistics.median(lengths) <= 330
    assert statistics.mean(lengths) > 2 * statistics.median(lengths)     # the tail carries most tokens
    assert max(lengths) == 8192                                           # and reaches the cap
    assert bw.document_lengths(3_000_000, 300, 8192, seed=2) != lengths


def test_the_full_sizes_are_the_training_shapes():
    rows = bw.workloads(bw.FULL)
    packed = [w for w in rows if w.family == "packed"]
    assert {sum(w.lengths) for w in packed} == {32768, 65536}
    assert {(w.heads, w.kv_heads) for w in packed} == {(16, 16), (32, 8)}
    assert all(w.packed and w.causal and max(w.lengths) <= 8192 and 100 <= statistics.median(w.lengths) <= 1000
               for w in packed)
    windows = [w for w in rows if w.family == "window"]
    assert {w.window for w in windows} == {1024, 4096}
    assert all(8192 <= w.lengths[0] <= 16384 and (w.heads, w.kv_heads) == (32, 8) for w in windows)
    assert {w.lengths for w in rows if w.family == "long"} == {(32768,), (65536,), (131072,)}
    assert {w.lengths[0] for w in rows if w.family == "short"} == {512, 1024}
    assert {w.head_dim for w in rows if w.family == "short"} == {64, 128}
    deterministic = [w for w in rows if w.family == "deterministic"]
    assert deterministic and all(w.deterministic and w.causal and w.lengths[0] == 8192 for w in deterministic)
    assert {w.family for w in rows} == set(bw.FAMILIES)


@pytest.mark.parametrize("name", ["sdpa_cudnn", "sdpa_flash", "flex"])
@pytest.mark.parametrize("option", [dict(window=8), dict(deterministic=True), dict(varlen="packed")])
def test_peers_without_the_feature_are_skipped_not_run(name, option):
    q = torch.randn(32, 2, 16)
    if option.get("varlen"):
        option = dict(varlen=(torch.tensor([0, 12, 32], dtype=torch.int32), 20))
    with pytest.raises(bench_bwd.Unsupported):
        bench_bwd.make_runner(name, q, q, q, True, **option)


@pytest.mark.parametrize("window", [None, 0, 3, 9])
def test_the_runner_attends_exactly_the_counted_pairs(window):
    """Packed documents through the reference runner equal dense attention per document over the pairs
    attended_pairs counts (causal, keys i - window .. i)."""
    w = bw.Workload("packed", "t", 16, 4, 2, (5, 1, 12, 7), packed=True, window=window)
    (q, k, v), varlen = bw.inputs(w, torch.device("cpu"))
    out = bench_bwd.make_runner("reference", q, k, v, True, window=window, varlen=varlen)().float()
    start, pairs = 0, 0
    for n in w.lengths:
        rows = torch.arange(n)
        keep = (rows[None, :] <= rows[:, None]) & ((rows[:, None] - rows[None, :] <= window) if window is not None
                                                    else True)
        pairs += int(keep.sum())
        qs, ks, vs = (t[start:start + n].float().transpose(0, 1) for t in (q, k, v))
        ks, vs = (t.repeat_interleave(2, dim=0) for t in (ks, vs))
        scores = (qs @ ks.transpose(1, 2) / 4.0).masked_fill(~keep, float("-inf"))
        expected = (scores.softmax(-1) @ vs).transpose(0, 1)
        torch.testing.assert_close(out[start:start + n], expected, atol=2e-2, rtol=2e-2)
        start += n
    assert w.pairs == pairs


def test_ratios_are_ours_over_each_measured_peer():
    peers = {"triton": dict(step_tflops=300.0, fwd_tflops=400.0, bwd_tflops=250.0),
             "fa4": dict(step_tflops=400.0, fwd_tflops=500.0, bwd_tflops=200.0),
             "sdpa_cudnn": dict(skipped="no varlen")}
    assert bw.ratios(peers, "triton", bw.PASSES) == dict(step_fa4=0.75, fwd_fa4=0.8, bwd_fa4=1.25)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    report = bw.main(["--out", str(out)])
    return out, report


def test_a_cpu_run_reports_useful_tflops_of_every_row(cpu_run):
    out, report = cpu_run
    assert report["meta"]["ours"] == "reference" and report["meta"]["sizes"] == "tiny"
    assert {r["family"] for r in report["results"]} == set(bw.FAMILIES)
    for row in report["results"]:
        ours = row["peers"]["reference"]
        pairs = sum(mask_pairs(n, n, row["causal"], row["window"]) for n in row["lengths"])
        assert row["pairs"] == pairs
        for kind, forwards in (("fwd", 1.0), ("bwd", 2.5), ("step", 3.5)):
            expected = forwards * 4 * row["head_dim"] * row["heads"] * pairs / ours[f"{kind}_ms"] / 1e9
            assert ours[f"{kind}_tflops"] == pytest.approx(expected, rel=1e-9)
        assert row["peers"]["fa4"] == {"skipped": "needs CUDA"} == row["peers"]["sdpa_cudnn"]
        assert row["ratios"] == {}


def test_a_cpu_run_writes_json_markdown_and_plot(cpu_run):
    out, report = cpu_run
    stem = out / f"cpu-{report['meta']['date']}-workloads"
    assert json.loads(stem.with_suffix(".json").read_text()) == json.loads(json.dumps(report))
    table = [line for line in stem.with_suffix(".md").read_text().splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(report["results"])
    for line, row in zip(table[1:], report["results"]):
        cells = line.strip("| ").split(" | ")
        assert cells[:2] == [row["family"], row["name"]]
        assert float(cells[2]) == pytest.approx(row["peers"]["reference"]["step_tflops"], rel=0.06)
    assert stem.with_suffix(".png").stat().st_size > 1000


def test_fa4_that_does_not_import_stays_a_column_that_says_why(tmp_path, monkeypatch):
    """On a CUDA machine without flash_attn.cute every row records FA4 as skipped with the reason, and the
    markdown says so once for all rows (the kernels themselves are not run here)."""
    monkeypatch.setattr(bw.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bw.torch.cuda, "get_device_name", lambda: "Fake GPU")
    monkeypatch.setattr(bw, "fa4_version", lambda names: None)
    monkeypatch.setattr(bw, "measure", lambda w, peer, device: dict(step_tflops=1.0, fwd_tflops=1.0, bwd_tflops=1.0))
    report = bw.main(["--out", str(tmp_path), "--families", "packed,long"])
    assert report["meta"]["peers"] == ["triton", "fa4", "sdpa_cudnn"]
    assert all(r["peers"]["fa4"] == {"skipped": "flash_attn.cute does not import here"} for r in report["results"])
    assert "- FA4: flash_attn.cute does not import here (all rows)" in bw.markdown(report)
