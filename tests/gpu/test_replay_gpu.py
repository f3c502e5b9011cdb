"""On a CUDA GPU: calls whose launches backends/triton/runtime/replay.py re-issues give what running the methods
gives. What is and is not recorded, on the CPU with fake kernels: tests/triton/test_replay.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from flash_attn_ck.backends.triton.runtime import replay

# ---- on the GPU: replayed calls give what running the methods gives --------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (b, s, h, h_k, d, causal, varlen, deterministic, extra options): the one-launch kernels (short), the
# warp-specialised ones (s >= 2048; varlen from s1024 at d128), GQA, varlen, deterministic, ALiBi, softcap, dropout
GPU_CASES = [(2, 128, 4, 4, 128, True, False, False, {}),
             (1, 512, 4, 2, 64, False, False, False, dict(softcap=20.0)),
             (1, 4096, 4, 4, 128, True, False, False, {}),
             (1, 2048, 4, 2, 128, True, False, True, {}),
             (3, 300, 4, 2, 64, True, True, False, {}),
             (2, 256, 4, 4, 96, False, False, False, dict(alibi=True)),
             (2, 256, 4, 4, 64, True, False, False, dict(dropout_p=0.2)),
             # the warp-specialised backward in one launch per kv head (its fp32 dQ above BWD_WS_DQ_ACCUM_BYTES)
             (1, 1024, 8, 2, 128, True, False, False, dict(launches=2)),
             (2, 1024, 8, 2, 128, False, False, True, dict(launches=2)),
             # varlen on the warp-specialised kernels: their tile schedules are scratch tensors of each call
             (2, 1024, 4, 2, 128, True, True, False, {}),
             (2, 1024, 8, 2, 128, True, True, True, dict(launches=2))]


def _step(backend, q, k, v, dout, causal, varlen, deterministic, extra, seed):
    import flash_attn_ck as fa
    extra = dict(extra)
    if extra.pop("alibi", False):
        extra["alibi_slopes"] = torch.linspace(0.1, 1.0, q.shape[-2], device="cuda")
    torch.manual_seed(seed)         # the dropout pattern's draw
    if varlen:
        lengths = [q.shape[1] // 3, q.shape[1], 1]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        rows = int(cu[-1]) + 5        # rows after the last sequence: the outside-rows fills write them
        flat = [t.flatten(0, 1)[:rows].detach().requires_grad_() for t in (q, k, v)]
        out = fa.flash_attn_varlen_func(*flat, cu, cu, max(lengths), max(lengths), causal=causal,
                                        deterministic=deterministic, backend=backend, **extra)
        grads = torch.autograd.grad(out, flat, dout.flatten(0, 1)[:rows])
    else:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fa.flash_attn_func(*leaves, causal=causal, deterministic=deterministic, backend=backend, **extra)
        grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), *grads


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"b{c[0]}s{c[1]}h{c[2]}/{c[3]}d{c[4]}"
                         f"{'-causal' if c[5] else ''}{'-varlen' if c[6] else ''}{'-det' if c[7] else ''}"
                         f"{''.join('-' + k for k in c[8])}")
def test_replayed_calls_match_the_methods(monkeypatch, case):
    """Three calls of one signature with fresh tensors each (the later ones replayed where the layout allows), then
    a misaligned q and a dout of other strides (new layouts: recorded anew): each equal to a backend that
    replays nothing, the varlen outside-rows fills included (dQ to fp32 rounding where it is added atomically)."""
    from flash_attn_ck.backends.triton import TritonBackend
    from flash_attn_ck.backends.triton import backend as triton_backend
    b, s, h, h_k, d, causal, varlen, deterministic, extra = case
    if launches := extra.get("launches"):
        from flash_attn_ck.backends.triton import config
        monkeypatch.setattr(config, "BWD_WS_DQ_ACCUM_BYTES", b * s * (h // launches) * d * 4)
        extra = {k: v for k, v in extra.items() if k != "launches"}
    runs = []
    real_run = replay.Replay.run
    monkeypatch.setattr(replay.Replay, "run", lambda self, *args: (runs.append(1), real_run(self, *args)))
    replaying = TritonBackend()
    for call in range(5):
        g = torch.Generator(device="cuda").manual_seed(call)
        q = torch.randn(b * s * h * d + 4, device="cuda", dtype=torch.bfloat16, generator=g)
        q = q[4 if call == 3 else 0:][:b * s * h * d].view(b, s, h, d)     # call 3: the base 8 bytes off, same strides
        k, v = (torch.randn(b, s, h_k, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        if call == 4:
            dout = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        got = _step(replaying, q, k, v, dout, causal, varlen, deterministic, extra, seed=call)
        with monkeypatch.context() as m:
            m.setattr(triton_backend, "REPLAYS_PER_PROBLEM", 0)
            m.setattr(triton_backend, "FILL_REPLAYS", 0)
            want = _step(TritonBackend(), q, k, v, dout, causal, varlen, deterministic, extra, seed=call)
        for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
            if name == "dq" and not deterministic:
                torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2, msg=f"call {call}: {name}")
            else:
                assert torch.equal(x, y), f"call {call}: {name} differs by {(x.float() - y.float()).abs().max()}"
    if s < 2048 and not extra:      # calls 2-3 replay fwd and bwd at least (the ws kernels' several launches too)
        assert len(runs) >= 4, f"{len(runs)} replays"
