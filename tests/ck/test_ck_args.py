"""The CK argument builders against flash-attention's `get_ck_fmha_bwd_args` rules, on CPU tensors.

Batch mode: every (b, s, h, d) tensor gives (batch, row, head) = strides 0, 1, 2; lse and D
(b, h, s_q) give strides 0, 1; dq_acc (splits, b, s_q, h, d) gives its split stride and strides
1, 2, 3. Group mode (varlen): batch strides are 0, rows and heads are strides 0, 1, lse/D are
(h, total_q), seqstart = cu_seqlens and seqlen_q/k are the packed totals. MQA/GQA point dk/dv at
the expanded per-query-head buffers; p_undrop = 1 - p; ALiBi's batch stride is 0 for (h,) slopes.
"""

from __future__ import annotations

import ctypes
import math
from types import SimpleNamespace

import pytest
import torch

from flash_attn_ck.backends.ck import backend as ck
from flash_attn_ck.backends.ck.plan import ck_backward_plan
from flash_attn_ck.core.inputs import describe_call, kernel_params
from flash_attn_ck.core.mask import MaskType
from flash_attn_ck.core.options import AttentionOptions


def make_call(*, b=2, s_q=5, s_k=7, h=4, h_k=4, d=16, dtype=torch.float16, causal=False, window=(-1, -1),
              dropout_p=0.0, deterministic=False, alibi_shape=None, lengths=None, strided=False, softcap=0.0,
              d_v=None):
    """One backward call's tensors and its two structs. `lengths`: varlen [(s_q, s_k), ...]; `d_v`: v's head dim
    (None: d)."""
    varlen = lengths is not None
    d_v = d if d_v is None else d_v
    if varlen:
        cu_q = torch.tensor([0] + [sum(q for q, _ in lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
        cu_k = torch.tensor([0] + [sum(k for _, k in lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
        rows_q, rows_k = (int(cu_q[-1]),), (int(cu_k[-1]),)
        b = len(lengths)
        s_q, s_k = max(q for q, _ in lengths), max(k for _, k in lengths)
    else:
        cu_q = cu_k = None
        rows_q, rows_k = (b, s_q), (b, s_k)

    if strided:
        # q from a packed qkv-like buffer, k/v transposed from a heads-first layout.
        q = torch.randn(*rows_q, 3, h, d, dtype=dtype).select(-3, 0)
        k = torch.randn(*rows_k[:-1], h_k, rows_k[-1], d, dtype=dtype).transpose(-3, -2)
        v = torch.randn(*rows_k[:-1], h_k, rows_k[-1], d_v, dtype=dtype).transpose(-3, -2)
        out = torch.randn(*rows_q, h, 2 * d_v, dtype=dtype)[..., :d_v]
        dout = torch.randn(*rows_q[:-1], h, rows_q[-1], d_v, dtype=dtype).transpose(-3, -2)
    else:
        q = torch.randn(*rows_q, h, d, dtype=dtype)
        k = torch.randn(*rows_k, h_k, d, dtype=dtype)
        v = torch.randn(*rows_k, h_k, d_v, dtype=dtype)
        out = torch.randn(*rows_q, h, d_v, dtype=dtype)
        dout = torch.randn(*rows_q, h, d_v, dtype=dtype)
    alibi = None
    if alibi_shape == "h":
        alibi = torch.rand(h)
    elif alibi_shape == "bh":
        alibi = torch.rand(b, h)
    elif alibi_shape == "bh-slice":
        alibi = torch.rand(b, 2 * h)[:, :h]     # row stride 2h, not h
    rng_state = torch.tensor([1234, 5678], dtype=torch.int64) if dropout_p > 0 else None

    options = AttentionOptions(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi,
                               dropout_p=dropout_p, deterministic=deterministic, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               max_seqlen_q=s_q if varlen else None, max_seqlen_k=s_k if varlen else None)
    problem = describe_call(q, k, v, options)
    params = kernel_params(problem, q, k, v, options, rng_state)
    lse = torch.empty(problem.lse_shape, dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    workspace = ck_backward_plan(problem, "ck").allocate(torch.device("cpu"))
    args = ck.backward_args(problem, params, out, lse, dout, dq, dk, dv, workspace)
    return SimpleNamespace(problem=problem, params=params, out=out, lse=lse, dout=dout, dq=dq, dk=dk, dv=dv,
                           workspace=workspace, args=args, fwd=ck.attention_args(problem, params, out, lse))


def strides_of(arg: ck.FackTensor) -> tuple[int, int, int]:
    return arg.batch_stride, arg.row_stride, arg.head_stride


def seed_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def assert_tensor(arg: ck.FackTensor, t: torch.Tensor, varlen: bool) -> None:
    assert (arg.data or 0) == t.data_ptr()
    assert strides_of(arg) == seed_strides(t, varlen)


def assert_seed_rules(c) -> None:
    """Every struct field flash-attention's CK frontend derives from tensors, for any call."""
    p, a, varlen = c.problem, c.args, c.problem.varlen
    attn = a.attn
    for arg, t in ((attn.q, c.params.q), (attn.k, c.params.k), (attn.v, c.params.v), (attn.out, c.out),
                   (a.dout, c.dout), (a.dq, c.dq)):
        assert_tensor(arg, t, varlen)
    dk_target = c.workspace["dk_expanded"] if p.is_gqa else c.dk
    dv_target = c.workspace["dv_expanded"] if p.is_gqa else c.dv
    assert_tensor(a.dk, dk_target, varlen)
    assert_tensor(a.dv, dv_target, varlen)

    lse_strides = (0, c.lse.stride(0)) if varlen else (c.lse.stride(0), c.lse.stride(1))
    assert (attn.lse.batch_stride, attn.lse.head_stride) == lse_strides
    assert (a.d.batch_stride, a.d.head_stride) == lse_strides          # D shares lse's strides
    assert a.d.data == c.workspace["softmax_d"].data_ptr()

    acc = c.workspace["dq_accum"]
    assert a.dq_acc.data == acc.data_ptr()
    assert a.dq_acc_split_stride == acc.stride(0)
    assert strides_of(a.dq_acc) == ((0, acc.stride(1), acc.stride(2)) if varlen
                                    else (acc.stride(1), acc.stride(2), acc.stride(3)))

    assert (attn.nhead_q, attn.nhead_k) == (p.heads_q, p.heads_k)
    assert (attn.head_dim_q, attn.head_dim_v) == (p.head_dim_padded, p.head_dim_v_padded)
    assert (attn.max_seqlen_q, attn.max_seqlen_k, attn.batch) == (p.seqlen_q, p.seqlen_k, p.batch)
    assert attn.softmax_scale == pytest.approx(p.softmax_scale, rel=1e-7)
    assert a.p_undrop == pytest.approx(1.0 - p.dropout_p, rel=1e-7)
    assert attn.p_drop == pytest.approx(p.dropout_p, rel=1e-7)
    assert a.deterministic == int(p.deterministic)
    assert attn.dtype == {torch.float16: 0, torch.bfloat16: 1}[p.dtype]
    assert (attn.mask_type, attn.window_left, attn.window_right) == (int(p.mask.type), p.mask.left, p.mask.right)
    # The forward struct is the backward's first member, built the same way.
    assert bytes(c.fwd) == bytes(attn)


def test_contiguous_batch_mode_numbers():
    c = make_call(b=2, s_q=5, s_k=7, h=4, d=16)
    a = c.args
    assert strides_of(a.attn.q) == (5 * 4 * 16, 4 * 16, 16)
    assert strides_of(a.attn.k) == (7 * 4 * 16, 4 * 16, 16)
    assert (a.attn.lse.batch_stride, a.attn.lse.head_stride) == (4 * 5, 5)
    assert a.dq_acc_split_stride == 2 * 5 * 4 * 16
    assert (a.attn.group_mode, a.attn.seqlen_q, a.attn.seqlen_k) == (0, 5, 7)
    assert not a.attn.seqstart_q and not a.attn.seqstart_k
    assert not a.attn.alibi_slopes and a.attn.alibi_batch_stride == 0
    assert not a.attn.drop_seed and a.attn.p_drop == 0.0 and a.p_undrop == 1.0
    assert a.attn.mask_type == MaskType.NO_MASK and (a.attn.window_left, a.attn.window_right) == (-1, -1)
    assert a.attn.softmax_scale == pytest.approx(1 / math.sqrt(16))
    assert_seed_rules(c)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_strided_inputs(dtype):
    c = make_call(strided=True, dtype=dtype)
    assert c.params.q.stride() != c.params.q.contiguous().stride()      # really strided
    assert_seed_rules(c)
    assert c.args.attn.k.head_stride == 7 * 16                           # heads-first k: head stride s_k * d


def test_gqa_uses_expanded_dk_dv():
    c = make_call(h=8, h_k=2)
    assert c.args.attn.nhead_k == 2
    assert c.args.dk.data == c.workspace["dk_expanded"].data_ptr()
    assert c.args.dv.data == c.workspace["dv_expanded"].data_ptr()
    assert c.args.dk.head_stride == 16 and c.args.dk.row_stride == 8 * 16    # per query head
    assert_seed_rules(c)


@pytest.mark.parametrize("d,s_k,splits", [(64, 300, 3), (128, 129, 2), (256, 300, 5)])
def test_deterministic_split_stride(d, s_k, splits):
    c = make_call(d=d, s_k=s_k, deterministic=True)
    acc = c.workspace["dq_accum"]
    assert acc.shape[0] == splits                      # kN0 = 128 for d <= 128, else 64
    assert c.args.deterministic == 1
    assert c.args.dq_acc_split_stride == 2 * 5 * 4 * d
    assert_seed_rules(c)


@pytest.mark.parametrize("strided", [False, True])
def test_varlen_group_mode(strided):
    lengths = [(3, 4), (0, 2), (6, 5)]
    c = make_call(lengths=lengths, h=4, h_k=2, strided=strided, deterministic=True)
    a = c.args.attn
    assert a.group_mode == 1
    assert (a.seqlen_q, a.seqlen_k) == (9, 11)               # packed totals
    assert (a.max_seqlen_q, a.max_seqlen_k) == (6, 5)
    assert a.seqstart_q == c.params.cu_seqlens_q.data_ptr()
    assert a.seqstart_k == c.params.cu_seqlens_k.data_ptr()
    assert a.q.batch_stride == a.k.batch_stride == a.lse.batch_stride == c.args.dq_acc.batch_stride == 0
    assert a.lse.head_stride == 9                            # lse (h, total_q)
    assert_seed_rules(c)


@pytest.mark.parametrize("causal,window,expected", [
    (True, (-1, -1), (MaskType.BOTTOM_RIGHT, -1, 0)),
    (False, (3, 2), (MaskType.BOTTOM_RIGHT, 3, 2)),
    (False, (-1, 1), (MaskType.BOTTOM_RIGHT, -1, 1)),
    (False, (100, 100), (MaskType.NO_MASK, -1, -1)),       # windows past s_k are unbounded
    (True, (2, 5), (MaskType.BOTTOM_RIGHT, 2, 0)),
])
def test_mask_from_mask_info(causal, window, expected):
    c = make_call(causal=causal, window=window)
    a = c.args.attn
    assert (a.mask_type, a.window_left, a.window_right) == tuple(map(int, expected))
    assert_seed_rules(c)


def test_dropout_pointers_and_p_undrop():
    c = make_call(dropout_p=0.17)
    rng = c.params.rng_state
    a = c.args
    assert a.attn.drop_seed == rng.data_ptr()
    assert a.attn.drop_offset == rng.data_ptr() + 8
    assert a.attn.p_drop == pytest.approx(0.17)
    assert a.p_undrop == pytest.approx(0.83)
    assert_seed_rules(c)


@pytest.mark.parametrize("shape,stride", [("h", 0), ("bh", 4), ("bh-slice", 8)])
def test_alibi_stride(shape, stride):
    c = make_call(alibi_shape=shape)
    assert c.args.attn.alibi_slopes == c.params.alibi_slopes.data_ptr()
    assert c.args.attn.alibi_batch_stride == stride
    assert_seed_rules(c)


def test_head_dim_is_the_padded_one():
    c = make_call(d=20)
    assert c.args.attn.head_dim_q == c.args.attn.head_dim_v == 24 and c.params.q.shape[-1] == 24
    assert_seed_rules(c)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize(("d", "d_v"), [(20, 13), (192, 128), (40, 72)])
def test_two_head_dims_each_padded(d, d_v, varlen):
    """CK's hdim_q and hdim_v travel separately, each padded to a multiple of 8, in both structs; v's, out's,
    dout's and dv's strides are of their own (d_v) tensors, with GQA's expanded dv too."""
    lengths = [(5, 7), (0, 3), (6, 2)] if varlen else None
    c = make_call(d=d, d_v=d_v, h=4, h_k=2, lengths=lengths)
    padded_q, padded_v = -(-d // 8) * 8, -(-d_v // 8) * 8
    for attn in (c.args.attn, c.fwd):
        assert (attn.head_dim_q, attn.head_dim_v) == (padded_q, padded_v)
    assert c.params.q.shape[-1] == c.params.k.shape[-1] == padded_q and c.params.v.shape[-1] == padded_v
    assert c.workspace["dv_expanded"].shape[-1] == padded_v and c.workspace["dk_expanded"].shape[-1] == padded_q
    assert c.workspace["dq_accum"].shape[-1] == padded_q
    assert_seed_rules(c)


def test_refuses_non_contiguous_last_dim():
    q = torch.randn(2, 5, 4, 32, dtype=torch.float16)[..., ::2]
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ck.tensor_arg("q", q, varlen=False)


def test_softcap_is_refused_not_ignored():
    problem = make_call(softcap=30.0).problem
    assert "softcap is not supported" in ck.CkBackend.not_supported_reasons(problem)


def test_unavailable_without_rocm_torch(monkeypatch):
    ck._load.cache_clear()
    monkeypatch.setattr(torch.version, "hip", None)
    try:
        assert "not a ROCm build" in ck.CkBackend.unavailable_reason()
    finally:
        ck._load.cache_clear()


def test_unavailable_without_library(monkeypatch, tmp_path):
    ck._load.cache_clear()
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    missing = tmp_path / "libflash_attn_ck.so"
    monkeypatch.setenv(ck.LIBRARY_ENV, str(missing))
    try:
        reason = ck.CkBackend.unavailable_reason()
        assert str(missing) in reason and ck.LIBRARY_ENV in reason
    finally:
        ck._load.cache_clear()


def test_struct_sizes_are_stable():
    # A change here is an ABI change: bump FACK_ABI_VERSION in the header and ck.ABI_VERSION.
    assert ctypes.sizeof(ck.FackAttention) == 312     # ABI 3: head_dim_q and head_dim_v
    assert ctypes.sizeof(ck.FackBwdArgs) == 312 + 5 * 32 + 24 + 8 + 8   # 5 tensors, d, split stride, p_undrop + flag
