"""The Triton backend's configuration on CPU: the dq_mode="auto" rule, EVEN_K, and invariants of every tile
table config.select can return (not their values, which retuning changes)."""

from __future__ import annotations

import pytest
import torch

from flash_attn_ck.backends.triton import operators
from flash_attn_ck.core.mask import MaskInfo
from flash_attn_ck.core.problem import AttentionProblem


def problem(device="cpu", **kw):
    return AttentionProblem(batch=1, seqlen_q=16, seqlen_k=16, heads_q=2, heads_k=2, head_dim=64, dtype=torch.bfloat16,
                            device=torch.device(device), mask=MaskInfo.from_flash_args(False, (-1, -1), 16, 16),
                            softmax_scale=0.125, **kw)


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
    from dataclasses import replace

    from flash_attn_ck.backends.triton import TritonBackend
    from flash_attn_ck.backends.triton.runtime import target
    monkeypatch.delenv("FLASH_ATTN_CK_TRITON_DQ", raising=False)
    monkeypatch.setattr(target, "capability", lambda device: capability)
    p = replace(problem(device="cuda"), head_dim=head_dim, head_dim_padded=head_dim, heads_k=heads_k,
                deterministic=deterministic, varlen=varlen, total_q=16 if varlen else 0, total_k=16 if varlen else 0,
                seqlen_q=seqlen, seqlen_k=seqlen)
    names = [b.name for b in TritonBackend(ws=False).backward_plan(p).buffers]   # the one-launch kernel's mode
    assert ("dq_accum" in names) is atomic
    assert "dq_accum" not in [b.name for b in TritonBackend(dq_mode="pass", ws=False).backward_plan(p).buffers]


def test_triton_configs_share_one_backward_launch():
    """Both backward roles run in one launch: a Configs whose key-tile and query-tile roles disagree
    on warps or stages is refused at construction (the tables themselves build at import)."""
    from flash_attn_ck.backends.triton import config
    fwd = config.Tile(64, 64, 4, 2)
    with pytest.raises(ValueError, match="num_warps and num_stages must match"):
        config.Configs(fwd, config.Tile(64, 128, 8, 3), config.Tile(128, 64, 4, 3))


def test_triton_select_changes_only_tile_transport():
    """config.select on sm_90: a call no longer than SHORT_SEQLEN moves its backward tiles by pointers,
    one no longer than FWD_SHORT_SEQLEN its forward tiles too; everything else (tiles, product order,
    EVEN_K) is the table row's at every length. Checked at each threshold and one past it."""
    from dataclasses import replace

    from flash_attn_ck.backends.triton import config
    assert config.FWD_SHORT_SEQLEN <= config.SHORT_SEQLEN
    lengths = sorted({1, config.FWD_SHORT_SEQLEN, config.FWD_SHORT_SEQLEN + 1, config.SHORT_SEQLEN,
                      config.SHORT_SEQLEN + 1, 8 * config.SHORT_SEQLEN})
    for (block, causal), row in config.SM90.items():
        for seqlen in lengths:
            chosen = config.select(block, causal, (9, 0), False, seqlen)
            assert chosen.bwd_tma == ("none" if seqlen <= config.SHORT_SEQLEN else row.bwd_tma), (block, seqlen)
            assert chosen.fwd_tma == (row.fwd_tma and seqlen > config.FWD_SHORT_SEQLEN), (block, seqlen)
            assert replace(chosen, bwd_tma=row.bwd_tma, fwd_tma=row.fwd_tma) == row, (block, causal, seqlen)


@pytest.mark.parametrize("seqlen_k, varlen, key_blocks, even", [
    (48, False, (16,), True), (47, False, (16,), False), (48, True, (16,), False),
    (8192, False, (128, 64), True), (8256, False, (128, 64), False),   # 8256 = 129 * 64: one role's tiles only
])
def test_triton_even_keys(seqlen_k, varlen, key_blocks, even):
    """EVEN_K (the kernels drop the mask branch of an unwindowed call) only when every key tile of
    every role in the launch is full; varlen lengths are unknown to the host, so never there."""
    from dataclasses import replace

    p = replace(problem(), seqlen_k=seqlen_k, varlen=varlen, total_k=seqlen_k if varlen else 0)
    assert operators.even_keys(p, *key_blocks) is even


def _all_triton_configs():
    """(table name, key, Configs) for every row select can return."""
    from flash_attn_ck.backends.triton import config
    tables = {"SM90": config.SM90, "SM90_SHORT": config.SM90_SHORT, "SM90_FWD_SHORT": config.SM90_FWD_SHORT,
              "GENERIC": config.GENERIC, "INTERPRETER": {None: config.INTERPRETER}}
    return [(name, key, c) for name, table in tables.items() for key, c in table.items()]


def _shared_memory_floor(resident_rows: int, walked_rows: int, stages: int, head_block: int) -> int:
    """Bytes of shared memory a program needs at least (16-bit operands): two tiles of `resident_rows`
    kept for the whole walk (K and V, or Q and dO) plus `stages` copies of the two tiles it walks. On the
    H200 the d128 one-launch backward compiled to 164 888 bytes; this floor gives 163 840 for it."""
    return 2 * 2 * head_block * (resident_rows + stages * walked_rows)


def test_triton_every_head_dim_has_a_config():
    """Every head dim the API accepts (<= 256) maps to a head block with a row in every table, causal or
    not, on sm_90, other GPUs and the interpreter."""
    from flash_attn_ck.backends.triton import config
    for d in range(1, 257):
        block = config.head_block(d)
        assert block >= d and block & (block - 1) == 0
        for causal in (False, True):
            for capability, interpreter in (((9, 0), False), ((8, 0), False), (None, False), (None, True)):
                for seqlen in (1, config.SHORT_SEQLEN + 1):
                    assert isinstance(config.select(d, causal, capability, interpreter, seqlen), config.Configs)


def test_triton_tiles_fit_the_hardware():
    """Invariants of every tile table (not its values, which retuning changes): blocks are powers of two
    that tl.dot takes (>= 16); the two backward roles share warps and stages (one launch); key blocks of
    the two roles divide one another (EVEN_K tests both); each role's shared memory floor fits the part
    the table is for (H200: 227 KiB per block; GENERIC: the ~99 KiB of consumer and Ampere parts)."""
    limits = {"SM90": 227 << 10, "SM90_SHORT": 227 << 10, "SM90_FWD_SHORT": 227 << 10, "GENERIC": 99 << 10}
    for name, key, c in _all_triton_configs():
        where = (name, key)
        for tile in (c.forward, c.bwd_kv, c.bwd_dq):
            for block in (tile.block_m, tile.block_n):
                assert block >= 16 and block & (block - 1) == 0, where
            assert tile.num_warps in (1, 2, 4, 8) and tile.num_stages >= 1, where
        assert (c.bwd_kv.num_warps, c.bwd_kv.num_stages) == (c.bwd_dq.num_warps, c.bwd_dq.num_stages), where
        small, large = sorted((c.bwd_kv.block_n, c.bwd_dq.block_n))
        assert large % small == 0, where
        if name in limits:
            head_block = key[0] if isinstance(key, tuple) else key
            fwd, kv, dq = c.forward, c.bwd_kv, c.bwd_dq
            needs = {"forward": _shared_memory_floor(fwd.block_m, fwd.block_n, fwd.num_stages, head_block),
                     "bwd_kv": _shared_memory_floor(kv.block_n, kv.block_m, kv.num_stages, head_block),
                     "bwd_dq": _shared_memory_floor(dq.block_m, dq.block_n, dq.num_stages, head_block)}
            assert max(needs.values()) <= limits[name], (where, needs)


def test_triton_unmeasured_tables_keep_the_defaults():
    """The product order and the EVEN_K switch are per-row measurements on the H200: the untuned GENERIC
    and INTERPRETER rows keep the source order and EVEN_K on."""
    from flash_attn_ck.backends.triton import config
    for c in [*config.GENERIC.values(), config.INTERPRETER]:
        assert not c.bwd_dp_first and c.bwd_even_k
