"""The main job runs end to end at a small size and reports errors, timings and the plan."""

from __future__ import annotations

import re

from flash_attn_ck.__main__ import main


def test_main_job_small(capsys):
    assert main(["--device", "cpu", "--batch", "1", "--seqlen", "96", "--seqlen-k", "130", "--heads", "4",
                 "--heads-k", "2", "--head-dim", "36", "--causal", "--deterministic", "--repeats", "1",
                 "--max-workspace-bytes", "200000"]) == 0
    text = capsys.readouterr().out
    assert "backend=reference" in text
    ratios = [float(r) for r in re.findall(r"^  \w+ +max.*ratio (\d+\.\d+)$", text, re.M)]
    assert len(ratios) == 4 and max(ratios) <= 2.0, text
    assert re.search(r"backward +\d+\.\d+ ms +\d+\.\d+ TFLOP/s", text)
    for buffer in ("softmax_d", "dq_accum", "q_padded"):
        assert buffer in text
    # Every backend chunks the backward under the 200000-byte cap (Triton's plan here: its padding buffers).
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    size = r"(\d+(?:\.\d)?) (B|KiB|MiB|GiB)"
    plans = {name: (float(cap) * units[cu], float(whole) * units[wu], int(chunks), float(peak) * units[pu])
             for name, cap, cu, whole, wu, chunks, peak, pu in re.findall(
                 rf"backward workspace \((\w+)\): cap {size}; unchunked {size}; (\d+) chunk\(s\); peak {size}", text)}
    assert set(plans) == {"reference", "ck", "triton"}, text
    for name, (cap, unchunked, chunks, peak) in plans.items():
        assert abs(cap - 200000) <= 0.05 * 1024, (name, cap)
        assert peak <= cap < unchunked and chunks >= 2, (name, plans[name])
    assert re.search(r"dq_accum +float32 +2x1x", text)      # deterministic: 2 splits of 128 keys
    assert "  triton: " in text and "  ck: " in text
