"""Backend declarations, refusals and selection."""

from __future__ import annotations

import pytest
import torch

import flash_attn_ck as fa
from flash_attn_ck.backends.registry import all_backend_classes, backend_class
from flash_attn_ck.pipeline.select import BACKEND_ENV, select_backend
from flash_attn_ck.core.mask import MaskInfo
from flash_attn_ck.core.problem import AttentionProblem


def problem(device="cpu", dtype=torch.bfloat16, **kw):
    return AttentionProblem(batch=1, seqlen_q=16, seqlen_k=16, heads_q=2, heads_k=2, head_dim=64, dtype=dtype,
                            device=torch.device(device), mask=MaskInfo.from_flash_args(False, (-1, -1), 16, 16),
                            softmax_scale=0.125, **kw)


def test_every_backend_declares_capabilities():
    for cls in all_backend_classes():
        assert cls.name in ("triton", "ck", "reference")
        assert isinstance(cls.not_supported_reasons(problem()), list)


def test_cpu_default_is_reference(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend(problem()).name == "reference"


def test_environment_variable_selects_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "ck")
    with pytest.raises(fa.NoBackendError, match=r"backend 'ck' cannot run"):
        select_backend(problem())
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert select_backend(problem()).name == "reference"


def test_reference_is_not_chosen_automatically_on_accelerators(monkeypatch):
    """A meta-device problem stands in for an accelerator: the slow oracle is never picked silently."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    with pytest.raises(fa.NoBackendError) as error:
        select_backend(problem(device="meta"))
    text = str(error.value)
    for name in ("triton", "ck", "reference"):
        assert f"\n  {name}: " in text
    assert "pass backend='reference'" in text or "device type 'meta'" in text


def test_declared_features_become_reasons():
    ck = backend_class("ck")
    reasons = ck.not_supported_reasons(problem(softcap=3.0))
    assert any("softcap is not supported" in r for r in reasons)
    reasons = ck.not_supported_reasons(problem(dtype=torch.float32))
    assert any("dtype float32" in r for r in reasons)


def test_fp32_runs_only_on_reference():
    q = torch.randn(1, 4, 2, 8)
    out = fa.flash_attn_func(q, q, q)
    assert out.dtype == torch.float32
    with pytest.raises(fa.NoBackendError, match=r"triton: .*dtype float32"):
        fa.flash_attn_func(q, q, q, backend="triton")


@pytest.mark.parametrize("capability, head_dim, heads_k, varlen, deterministic, seqlen, atomic", [
    ((9, 0), 128, 2, False, False, 4096, False),   # sm_90, dense: TMA tile loads, and with them the dQ pass wins
    ((9, 0), 128, 2, True, False, 4096, True),     # varlen loads by pointers: atomic dQ won there
    ((8, 0), 128, 2, False, False, 4096, True),    # no TMA before sm_90
    ((9, 0), 128, 2, False, False, 2048, False),   # short sequences: pointers, and the pass measured faster
    ((9, 0), 128, 2, True, False, 512, False),
    ((9, 0), 128, 1, False, False, 4096, False),   # GQA keeps the pass (memory)
    ((8, 0), 128, 2, False, True, 4096, False),    # deterministic: never atomics
    ((9, 0), 64, 2, False, False, 4096, False),    # head block 64: the pass
])
def test_triton_auto_dq_mode(monkeypatch, capability, head_dim, heads_k, varlen, deterministic, seqlen, atomic):
    """dq_mode="auto" (docs/triton.md): atomic dQ only for MHA with a 128 head block, not
    deterministic, sequences longer than config.SHORT_SEQLEN, where the backward loads its tiles by
    pointers; the plan holds dq_accum iff so."""
    pytest.importorskip("triton")
    from dataclasses import replace

    from flash_attn_ck.backends.triton import TritonBackend, backend
    monkeypatch.delenv("FLASH_ATTN_CK_TRITON_DQ", raising=False)
    monkeypatch.setattr(backend, "_capability", lambda device: capability)
    p = replace(problem(device="cuda"), head_dim=head_dim, head_dim_padded=head_dim, heads_k=heads_k,
                deterministic=deterministic, varlen=varlen, total_q=16 if varlen else 0, total_k=16 if varlen else 0,
                seqlen_q=seqlen, seqlen_k=seqlen)
    names = [b.name for b in TritonBackend(ws=False).backward_plan(p).buffers]   # the one-launch kernel's mode
    assert ("dq_accum" in names) is atomic
    assert "dq_accum" not in [b.name for b in TritonBackend(dq_mode="pass", ws=False).backward_plan(p).buffers]


def test_triton_configs_share_one_backward_launch():
    """Both backward roles run in one launch: a Configs whose key-tile and query-tile roles disagree
    on warps or stages is refused at construction (the tables themselves build at import)."""
    pytest.importorskip("triton")
    from flash_attn_ck.backends.triton import config
    fwd = config.Tile(64, 64, 4, 2)
    with pytest.raises(ValueError, match="num_warps and num_stages must match"):
        config.Configs(fwd, config.Tile(64, 128, 8, 3), config.Tile(128, 64, 4, 3))


@pytest.mark.parametrize("seqlen, bwd_tma, fwd_tma", [(512, "none", False), (1024, "none", False),
                                                      (1025, "none", True), (2048, "none", True),
                                                      (2049, "all", True), (8192, "all", True)])
def test_triton_short_sequences_move_tiles_by_pointers(seqlen, bwd_tma, fwd_tma):
    """config.select on sm_90: up to SHORT_SEQLEN the backward uses no TMA descriptors, up to
    FWD_SHORT_SEQLEN the forward neither (both measured faster there); longer calls keep the
    table's choice. Tiles do not change."""
    pytest.importorskip("triton")
    from flash_attn_ck.backends.triton import config
    table = config.SM90[(128, True)]
    chosen = config.select(128, True, (9, 0), False, seqlen)
    assert (chosen.bwd_tma, chosen.fwd_tma) == (bwd_tma, fwd_tma)
    assert (chosen.forward, chosen.bwd_kv, chosen.bwd_dq) == (table.forward, table.bwd_kv, table.bwd_dq)
    assert config.select(256, False, (9, 0), False, 8192).bwd_tma == "stores"


@pytest.mark.parametrize("seqlen_k, varlen, key_blocks, even", [
    (48, False, (16,), True), (47, False, (16,), False), (48, True, (16,), False),
    (8192, False, (128, 64), True), (8256, False, (128, 64), False),   # 8256 = 129 * 64: one role's tiles only
])
def test_triton_even_keys(seqlen_k, varlen, key_blocks, even):
    """EVEN_K (the kernels drop the mask branch of an unwindowed call) only when every key tile of
    every role in the launch is full; varlen lengths are unknown to the host, so never there."""
    pytest.importorskip("triton")
    from dataclasses import replace

    from flash_attn_ck.backends.triton import TritonBackend
    p = replace(problem(), seqlen_k=seqlen_k, varlen=varlen, total_k=seqlen_k if varlen else 0)
    assert TritonBackend._even_keys(p, *key_blocks) is even


def test_triton_dp_first_only_where_measured():
    """The dO V^T-before-exp2 order is a d256 choice (config.SM90's comment); no other row, no
    generic or interpreter config, turns it on."""
    pytest.importorskip("triton")
    from flash_attn_ck.backends.triton import config
    for seqlen in (512, 8192):
        assert [d for d in (32, 64, 128, 256) if config.select(d, False, (9, 0), False, seqlen).bwd_dp_first] == [256]
    assert not any(c.bwd_dp_first for c in config.GENERIC.values())
    assert not config.INTERPRETER.bwd_dp_first


def test_triton_backward_even_k_off_only_at_d256():
    """The backward's branch-free EVEN_K loops lost at d256 (config.SM90's comment): that row keeps the
    mask branch, every other table keeps EVEN_K on."""
    pytest.importorskip("triton")
    from flash_attn_ck.backends.triton import config
    for seqlen in (512, 8192):
        assert [d for d in (32, 64, 128, 256) if not config.select(d, False, (9, 0), False, seqlen).bwd_even_k] == [256]
    assert all(c.bwd_even_k for c in config.GENERIC.values()) and config.INTERPRETER.bwd_even_k
