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
    assert re.search(r"cap 195\.3 KiB; unchunked \d+\.\d KiB; [2-9]\d* chunk\(s\); peak", text), text
    assert re.search(r"dq_accum +float32 +2x1x", text)      # deterministic: 2 splits of 128 keys
    assert "  triton: " in text and "  ck: " in text
