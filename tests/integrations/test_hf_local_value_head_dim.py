"""The value head dim (d_v != d) and learnable sinks through the one-device HF attention (integrations/hf.py,
register_hf_attention_local): each test holds a class of input that was mishandled, named for the rule it checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_edge_cases import SETTINGS

import flash_attn_ck as fa

transformers = pytest.importorskip("transformers")

from flash_attn_ck.integrations.hf import register_hf_attention_local  # noqa: E402

NAME = register_hf_attention_local(name="ck_attention_round5", backend="reference")


@st.composite
def packed_rows(draw):
    """Rows of documents (lengths >= 1 summing to the row's length), given as restarting position_ids or as
    cu_seq_lens; d and d_v drawn apart; GQA; with or without a sink (s_aux)."""
    batch, seqlen = draw(st.integers(1, 2)), draw(st.integers(2, 9))
    rows = []
    for _ in range(batch):
        cuts = sorted(draw(st.sets(st.integers(1, seqlen - 1), min_size=1, max_size=3)))
        rows.append([b - a for a, b in zip([0, *cuts], [*cuts, seqlen])])
    heads_k = draw(st.integers(1, 2))
    return dict(rows=rows, seqlen=seqlen, heads_k=heads_k, heads=heads_k * draw(st.integers(1, 2)),
                head_dim=draw(st.integers(1, 40)), head_dim_v=draw(st.integers(1, 40)), sink=draw(st.booleans()),
                given=draw(st.sampled_from(["position_ids", "cu_seq_lens"])))


@settings(max_examples=15, **SETTINGS)
@given(case=packed_rows(), seed=st.integers(0, 2 ** 16))
def test_hf_local_packed_documents_with_a_value_head_dim_of_their_own(case, seed):
    """The one-device HF attention on documents packed in rows (varlen path) with v's head dim d_v != d: out
    (b, s, h, d_v), each document's rows equal to flash_attn_func on that document alone."""
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen, heads, heads_k = len(case["rows"]), case["seqlen"], case["heads"], case["heads_k"]
    query = torch.randn(batch, heads, seqlen, case["head_dim"], generator=gen, dtype=torch.float64)
    key = torch.randn(batch, heads_k, seqlen, case["head_dim"], generator=gen, dtype=torch.float64)
    value = torch.randn(batch, heads_k, seqlen, case["head_dim_v"], generator=gen, dtype=torch.float64)
    sink = torch.randn(heads, generator=gen, dtype=torch.float64) if case["sink"] else None
    lengths = [n for row in case["rows"] for n in row]
    if case["given"] == "position_ids":
        kwargs = dict(position_ids=torch.stack([torch.cat([torch.arange(n) for n in row]) for row in case["rows"]]))
    else:
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    attention = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[NAME]
    module = SimpleNamespace(is_causal=True, training=False)
    out, _ = attention(module, query, key, value, None, s_aux=sink, **kwargs)
    assert out.shape == (batch, seqlen, heads, case["head_dim_v"])
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    for b, row in enumerate(case["rows"]):
        start = 0
        for n in row:
            piece = slice(start, start + n)
            alone = fa.flash_attn_func(q[b:b + 1, piece], k[b:b + 1, piece], v[b:b + 1, piece], causal=True,
                                       learnable_sink=sink, backend="reference")
            torch.testing.assert_close(out[b:b + 1, piece], alone, atol=1e-12, rtol=1e-12)
            start += n
