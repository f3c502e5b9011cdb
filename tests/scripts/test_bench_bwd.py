"""scripts/bench_bwd.py on CPU: the row sets, each runner getting the row's feature (ours through a spy on the call,
FA4 through a stand-in module, SDPA through a spy on torch's function), the package's FLOP count, the ratio and
feature-cost columns from the measured numbers (a stand-in timer), peers without a feature skipped with the reason,
and a run of the features set with the reference backend at tiny sizes."""

from __future__ import annotations

import contextlib
import io
import json
import random
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_bwd as bb

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def twins_of(rows):
    """Each feature row's shape has a plain row in the same list."""
    plain = {r.shape for r in rows if r.feature == "none"}
    return all(r.shape in plain for r in rows)


def test_the_features_set_is_issue_45s_rows():
    rows = bb.feature_rows(quick=False)
    assert rows == bb.feature_rows(quick=True) and len(rows) == 30
    assert all(r.causal for r in rows) and {r.s for r in rows} == {2048, 8192}
    assert {(r.d, r.d_v, r.h, r.h_k) for r in rows if r.d_v != r.d} == {(192, 128, 16, 16), (192, 128, 32, 8)}
    assert {(r.d, r.h, r.h_k) for r in rows if r.feature == "sink"} == {(64, 64, 8), (128, 64, 8)}
    assert {(r.d, r.h, r.h_k) for r in rows if r.feature == "softcap"} == {(128, 16, 16), (256, 8, 8)}
    assert {(r.d, r.h, r.feature) for r in rows if r.feature in ("alibi", "dropout")} == \
        {(128, 16, "alibi"), (128, 16, "dropout"), (64, 32, "dropout"), (256, 8, "dropout")}
    assert twins_of(rows)


@pytest.mark.parametrize("quick", [True, False])
def test_the_grid_set_is_issue_44s_grid(quick):
    rows = bb.grid_rows(quick)
    plain = [r for r in rows if r.feature == "none"]
    lengths = {2048, 8192} if quick else {512, 1024, 2048, 4096, 8192, 16384}
    assert {(r.d, r.h, r.h_k) for r in plain} == {(64, 32, 32), (96, 21, 21), (128, 16, 16), (192, 10, 10),
                                                  (256, 8, 8), (128, 32, 8), (128, 64, 8)}
    assert {r.s for r in plain} == lengths and len(plain) == 7 * len(lengths) * 2
    deterministic = [r for r in rows if r.feature == "deterministic"]
    assert len(deterministic) == 14 and {r.s for r in deterministic} == {8192} and twins_of(rows)
    assert {r.feature for r in rows} == {"none", "deterministic"} and all(r.d_v == r.d for r in rows)


def test_the_default_set_is_todays_grid():
    seqs = [2048, 8192]
    before = [(d, 2048 // d, 2048 // d, s, c) for d in (64, 128, 256) for s in seqs for c in (False, True)]
    before += [(128, 32, 8, s, c) for s in (2048, 8192) for c in (False, True)]
    rows = bb.default_rows(quick=True)
    assert [(r.d, r.h, r.h_k, r.s, r.causal) for r in rows] == before
    assert all(r.feature == "none" and r.b == 16384 // r.s for r in rows)


def test_shards_split_the_rows_by_compile_key():
    args = bb.argparse.Namespace(shapes="", rows="features,grid", quick=True, dims="", features="", shard="",
                                 skip_done="")
    every = bb.selected_rows(args)
    shards = [bb.selected_rows(bb.argparse.Namespace(**{**vars(args), "shard": f"{i}/5"})) for i in range(5)]
    assert sorted(map(repr, every)) == sorted(repr(r) for shard in shards for r in shard)
    keys = [{r.compile_key() for r in shard} for shard in shards]
    assert all(not (a & b) for i, a in enumerate(keys) for b in keys[i + 1:])


@pytest.mark.parametrize("d, d_v, h, h_k, causal", [(192, 128, 16, 16, True), (64, 64, 64, 8, False),
                                                     (256, 256, 8, 8, True)])
def test_tflops_are_the_package_flop_count(d, d_v, h, h_k, causal):
    """docs/semantics.md §FLOPs: 2 b h s^2 (d + d_v) forward, 2 b h s^2 (3 d + 2 d_v) backward, halved when causal."""
    row = bb.Row(d, h, h_k, 2048, causal, d_v=d_v)
    fwd_ms, bwd_ms = random.uniform(0.5, 5), random.uniform(0.5, 5)
    measured = bb.with_tflops(row, dict(fwd_ms=fwd_ms, bwd_ms=bwd_ms))
    pairs = row.b * h * 2048 * 2048 / (2 if causal else 1)
    assert measured["fwd_tflops"] == pytest.approx(2 * pairs * (d + d_v) / fwd_ms / 1e9, rel=1e-12)
    assert measured["bwd_tflops"] == pytest.approx(2 * pairs * (3 * d + 2 * d_v) / bwd_ms / 1e9, rel=1e-12)


def expected_call(row: bb.Row) -> dict:
    """The feature arguments our call must carry for a row (the others at their defaults)."""
    return dict(learnable_sink=(row.h,) if row.feature == "sink" else None,
                softcap=bb.SOFTCAP if row.feature == "softcap" else 0.0,
                alibi_slopes=(row.h,) if row.feature == "alibi" else None,
                dropout_p=bb.DROPOUT_P if row.feature == "dropout" else 0.0,
                deterministic=row.feature == "deterministic")


def shapes_of(kwargs: dict) -> dict:
    return {name: tuple(v.shape) if isinstance(v, torch.Tensor) else v for name, v in kwargs.items()}


@pytest.mark.parametrize("feature", bb.FEATURES)
def test_each_feature_reaches_our_call(feature, monkeypatch):
    """A row's timed call passes its feature (and no other): a spy on flash_attn_func sees every call of the run."""
    calls = []
    real = bb.fa.flash_attn_func

    def spy(q, k, v, **kwargs):
        calls.append((tuple(v.shape), kwargs))
        return real(q, k, v, **kwargs)
    monkeypatch.setattr(bb.fa, "flash_attn_func", spy)
    row = bb.Row(192, 8, 2, 16, True, feature, d_v=128, tokens=32)
    timed = bb.measure_peer(row, "reference", CPU)
    assert timed["fwd_ms"] > 0 and timed["bwd_ms"] > 0
    assert calls and all(v_shape[-1] == 128 for v_shape, _ in calls)
    wanted = expected_call(row)
    for _, kwargs in calls:
        assert {name: shapes_of(kwargs)[name] for name in wanted} == wanted


@pytest.mark.parametrize("feature, argument", [("sink", "learnable_sink"), ("softcap", "softcap"),
                                               ("alibi", "alibi_slopes")])
def test_the_feature_changes_our_result(feature, argument):
    """The runner's output is the call with the feature, bit for bit, and not the plain call's."""
    row = bb.Row(64, 4, 2, 16, True, feature, tokens=32)
    (q, k, v, *_), features = bb.row_inputs(row, CPU)
    out = bb.make_runner("reference", q, k, v, True, features=features)()
    direct = bb.fa.flash_attn_func(q, k, v, causal=True, backend="reference",
                                   **{argument: getattr(features, argument)})
    assert torch.equal(out, direct)
    assert not torch.equal(out, bb.make_runner("reference", q, k, v, True)())


@pytest.fixture
def fake_fa4(monkeypatch):
    """flash_attn.cute.interface standing in for FA4: records each call's arguments, returns (out, lse)."""
    calls = []

    def flash_attn_func(q, k, v, **kwargs):
        calls.append((tuple(v.shape), kwargs))
        return q[..., :v.shape[-1]] * 1.0, None
    interface = types.SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_func)
    for name, module in (("flash_attn", types.ModuleType("flash_attn")), ("flash_attn.cute", types.ModuleType("c")),
                         ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


@pytest.mark.parametrize("feature", ["none", "sink", "softcap", "deterministic"])
def test_fa4_gets_the_features_it_has(feature, fake_fa4):
    row = bb.Row(192, 8, 2, 16, True, feature, d_v=128, tokens=32)
    leaves, features = bb.row_inputs(row, CPU)
    out = bb.make_runner("fa4", *leaves[:3], True, deterministic=feature == "deterministic", features=features)()
    assert out.shape[-1] == 128
    (v_shape, kwargs), = fake_fa4
    assert v_shape[-1] == 128 and kwargs["causal"] is True
    assert kwargs["learnable_sink"] is features.learnable_sink
    assert (features.learnable_sink is None) == (feature != "sink")
    assert kwargs["softcap"] == (bb.SOFTCAP if feature == "softcap" else 0.0)
    assert kwargs["deterministic"] == (feature == "deterministic")


@pytest.mark.parametrize("peer, feature, reason", [
    ("fa4", "alibi", "fa4: no ALiBi"), ("fa4", "dropout", "fa4: no dropout"),
    ("sdpa_cudnn", "sink", "no learnable sink"), ("sdpa_cudnn", "softcap", "no softcap"),
    ("sdpa_cudnn", "alibi", "ALiBi only as a materialised bias mask"),
    ("sdpa_cudnn", "deterministic", "no deterministic mode"), ("flex", "softcap", "no score_mod"),
    ("flex", "dropout", "flex: no dropout")])
def test_peers_without_the_feature_are_skipped_with_the_reason(peer, feature, reason, fake_fa4):
    row = bb.Row(64, 4, 2, 16, True, feature, tokens=32)
    leaves, features = bb.row_inputs(row, CPU)
    with pytest.raises(bb.Unsupported, match=reason):
        bb.make_runner(peer, *leaves[:3], True, deterministic=feature == "deterministic", features=features)
    assert not fake_fa4
    assert reason in bb.measure_peer(row, peer, CPU)["skipped"]


@pytest.mark.parametrize("feature", ["none", "dropout"])
def test_sdpa_gets_v_head_dim_and_dropout(feature, monkeypatch):
    calls = []

    def spy(q, k, v, **kwargs):
        calls.append((tuple(v.shape), kwargs))
        return torch.zeros(*q.shape[:-1], v.shape[-1])
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    row = bb.Row(192, 8, 2, 16, True, feature, d_v=128, tokens=32)
    leaves, features = bb.row_inputs(row, CPU)
    bb.make_runner("sdpa_cudnn", *leaves[:3], True, features=features)()
    (v_shape, kwargs), = calls
    assert v_shape[-1] == 128 and kwargs["enable_gqa"] is True
    assert kwargs["dropout_p"] == (bb.DROPOUT_P if feature == "dropout" else 0.0)


@pytest.fixture
def stand_in_run(tmp_path, monkeypatch):
    """The features set on a pretend GPU, each timing drawn at random by a stand-in timer (the rest of the run
    real: refusals, FLOPs, ratios, costs, markdown). Returns the report, the drawn times and the output folder."""
    drawn = {}

    def stand_in_timer(row, name, device, warm_only=False):
        drawn[row.label, name] = dict(fwd_ms=random.uniform(0.5, 9), bwd_ms=random.uniform(1, 20),
                                      bwd_peak_mib=random.uniform(100, 600), first_call_s=0.1)
        return dict(drawn[row.label, name])
    monkeypatch.setattr(bb.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bb.torch.cuda, "get_device_name", lambda: "Fake GPU")
    monkeypatch.setattr(bb.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bb, "fa4_version", lambda names: "4.0-test")
    monkeypatch.setattr(bb, "time_row", stand_in_timer)
    report = bb.main(["--rows", "features", "--peers", "triton,fa4,sdpa_cudnn", "--out", str(tmp_path)])
    return report, drawn, tmp_path


def table(md: str) -> list[dict]:
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    head = lines[0].strip("| ").split(" | ")
    return [dict(zip(head, line.strip("| ").split(" | "))) for line in lines[1:] if not line.startswith("| d |")]


def test_ratio_and_cost_columns_are_computed_from_the_measured_times(stand_in_run):
    report, drawn, out = stand_in_run
    results = report["results"]
    assert len(results) == 30 and report["meta"]["ours"] == "triton"
    rows = table((out / "fake-gpu-{}.md".format(report["meta"]["date"])).read_text())
    assert len(rows) == len(results)
    for r, cells in zip(results, rows):
        row = bb.Row.from_result(r)
        ours = drawn[row.label, "triton"]
        for peer, title in (("fa4", "FA4"), ("sdpa_cudnn", "cuDNN")):
            if (row.label, peer) not in drawn:
                assert r["peers"][peer]["skipped"] == bb.row_refusal(peer, row)
                assert cells[f"bwd ours / {title}"] == "-"
                continue
            for kind in ("fwd", "bwd"):      # the same FLOPs: ours / peer in TFLOP/s = peer's ms / ours' ms
                expected = drawn[row.label, peer][f"{kind}_ms"] / ours[f"{kind}_ms"]
                assert r["ratios"][f"{kind}_{peer}"] == pytest.approx(expected, rel=1e-12)
                assert cells[f"{kind} ours / {title}"] == f"{expected:.2f}"
        assert cells["MiB ours"] == f"{ours['bwd_peak_mib']:.0f}"
        if row.feature == "none":
            assert "cost" not in r and cells["feature cost bwd"] == "-"
            continue
        plain = drawn[row.plain().label, "triton"]
        for kind in ("fwd", "bwd"):
            expected = ours[f"{kind}_ms"] / plain[f"{kind}_ms"] - 1
            assert r["cost"][kind] == pytest.approx(expected, rel=1e-12)
            assert cells[f"feature cost {kind}"] == f"{100 * expected:+.0f}%"


def test_fa4_and_sdpa_rows_the_features_leave_out_are_skipped_with_the_reason(stand_in_run):
    report, _, out = stand_in_run
    by_feature = {}
    for r in report["results"]:
        for peer, result in r["peers"].items():
            by_feature.setdefault((r["feature"], peer), set()).add(result.get("skipped", "measured"))
    assert by_feature["alibi", "fa4"] == {"fa4: no ALiBi (flash_attn.cute takes no alibi_slopes)"}
    assert by_feature["dropout", "fa4"] == {"fa4: no dropout (flash_attn.cute takes no dropout_p)"}
    assert by_feature["sink", "fa4"] == by_feature["softcap", "fa4"] == by_feature["none", "fa4"] == {"measured"}
    assert by_feature["dropout", "sdpa_cudnn"] == by_feature["none", "sdpa_cudnn"] == {"measured"}
    assert by_feature["sink", "sdpa_cudnn"] == {"sdpa_cudnn: no learnable sink"}
    md = (out / "fake-gpu-{}.md".format(report["meta"]["date"])).read_text()
    assert "- FA4: fa4: no ALiBi (flash_attn.cute takes no alibi_slopes) (d128 h16/16 s2048 causal alibi; " \
           "d128 h16/16 s8192 causal alibi)" in md


def test_a_merge_computes_the_cost_across_parts(stand_in_run, tmp_path):
    report, drawn, out = stand_in_run
    plain = [r for r in report["results"] if r["feature"] == "none"]
    featured = [r for r in report["results"] if r["feature"] != "none"]
    parts = []
    for name, results in (("a", plain), ("b", [{k: v for k, v in r.items() if k != "cost"} for r in featured])):
        parts.append(tmp_path / f"{name}.json")
        parts[-1].write_text(json.dumps(dict(meta=report["meta"], results=results)))
    bb.main(["--merge", ",".join(map(str, parts)), "--out", str(tmp_path), "--tag=-merged"])
    merged = json.loads((tmp_path / f"fake-gpu-{report['meta']['date']}-merged.json").read_text())
    costs = {bb.Row.from_result(r).label: r.get("cost") for r in merged["results"]}
    assert costs == {bb.Row.from_result(r).label: r.get("cost") for r in plain + featured}


def test_an_earlier_run_replots_with_its_ratios(tmp_path):
    """A json written before rows had features (the stored H200 grid) reads back: ours / FA4 from its numbers."""
    stored = json.loads((REPO / "bench" / "nvidia-h200.json").read_text())["grid"]["result"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(stored))
    bb.main(["--replot", str(path)])
    rows = table((tmp_path / "old.md").read_text())
    assert len(rows) == len(stored["results"])
    for r, cells in zip(stored["results"], rows):
        expected = r["peers"]["triton"]["bwd_tflops"] / r["peers"]["fa4"]["bwd_tflops"]
        assert cells["bwd ours / FA4"] == f"{expected:.2f}" and cells["feature"] == "none"


def test_the_plan_counts_what_compiles():
    rows = bb.feature_rows(quick=True)
    estimate = bb.plan(rows, ["triton", "fa4", "sdpa_cudnn"], warm_shards=12)
    assert estimate["rows"] == 30
    assert estimate["compile_keys"] == dict(ours=15, fa4=11, sdpa=14)
    assert estimate["runs"] == 30 + (30 - 8) + 20       # FA4 refuses ALiBi and dropout; cuDNN runs plain and dropout
    assert estimate["warmed_total_s"] < estimate["one_process_s"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    return out, bb.main(["--rows", "features", "--peers", "triton,fa4,sdpa_cudnn", "--out", str(out)])


def test_a_cpu_run_times_every_row_through_the_reference(cpu_run):
    out, report = cpu_run
    assert report["meta"]["ours"] == "reference" and report["meta"]["sizes"] == "tiny"
    assert [bb.Row.from_result(r) for r in report["results"]] == \
        [bb.dataclasses.replace(r.tiny(), row_set="features") for r in bb.feature_rows(quick=True)]
    for r in report["results"]:
        row = bb.Row.from_result(r)
        ours = r["peers"]["reference"]
        assert ours["fwd_tflops"] == pytest.approx(row.problem().forward_flops() / ours["fwd_ms"] / 1e9, rel=1e-12)
        assert ours["bwd_tflops"] == pytest.approx(row.problem().backward_flops() / ours["bwd_ms"] / 1e9, rel=1e-12)
        for peer in ("fa4", "sdpa_cudnn"):
            assert r["peers"][peer] == dict(skipped=bb.row_refusal(peer, row) or "needs CUDA")
        assert r["ratios"] == {} and (row.feature == "none") == ("cost" not in r)
    stem = out / f"cpu-{report['meta']['date']}"
    assert json.loads(stem.with_suffix(".json").read_text()) == json.loads(json.dumps(report))
    assert len(table(stem.with_suffix(".md").read_text())) == 30
    assert stem.with_suffix(".png").stat().st_size > 1000


def test_the_budget_leaves_rows_unreached_and_says_which(tmp_path):
    report = bb.main(["--shapes", "64:2:2:512:1,64:2:2:1024:0", "--peers", "triton", "--budget-s", "1e-9",
                      "--out", str(tmp_path)])
    assert report["results"] == [] and report["meta"]["not_reached"] == ["shapes: d64 h2/2 s8 causal",
                                                                         "shapes: d64 h2/2 s8 full"]


def test_skip_done_leaves_out_the_rows_a_cut_off_run_holds(stand_in_run, tmp_path):
    report, _, out = stand_in_run
    part = tmp_path / "part.json"
    part.write_text(json.dumps(dict(meta=report["meta"], results=report["results"][:10])))
    args = bb.argparse.Namespace(shapes="", rows="features,grid", quick=True, dims="", features="", shard="",
                                 skip_done=str(part))
    left = bb.selected_rows(args)
    every = bb.selected_rows(bb.argparse.Namespace(**{**vars(args), "skip_done": ""}))
    assert left == every[10:]


@settings(max_examples=50, deadline=None)
@given(feature=st.text(max_size=12).filter(lambda x: x not in bb.FEATURES))
def test_a_row_refuses_an_unknown_feature(feature):
    with pytest.raises(ValueError, match=r"Row\.feature: expected one of"):
        bb.Row(64, 2, 2, 16, True, feature)


@settings(max_examples=30, deadline=None)
@given(name=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10).filter(
    lambda x: x not in bb.ROW_SETS))
def test_an_unknown_row_set_is_refused_naming_the_option(name):
    err = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stderr(err):
        bb.main(["--rows", f"features,{name}", "--plan"])
    assert f"--rows: unknown ['{name}']" in err.getvalue()


def test_features_keeps_the_named_features_and_their_plain_twins():
    rows = bb.feature_rows(quick=True)
    kept = bb.selected_rows(bb.argparse.Namespace(shapes="", rows="features", quick=True, dims="", features="dropout",
                                                  skip_done="", shard=""))
    dropout = [r for r in rows if r.feature == "dropout"]
    assert {r.feature for r in kept} == {"dropout", "none"} and len(kept) == 2 * len(dropout)
    assert twins_of(kept) and {r.shape for r in kept} == {r.shape for r in dropout}
