"""Forward + backward with dropout run twice (CUDA graph replays on a GPU, plain calls elsewhere), and the check that
each run drew a fresh pattern and used it in both directions (the method: tests/gpu/test_cuda_graphs.py's
docstring). On a GPU: tests/gpu/test_cuda_graphs.py; on the CPU reference backend: tests/api/test_dropout_replays.py."""

from __future__ import annotations

import torch

from flash_attn_ck import flash_attn_bwd, flash_attn_func, flash_attn_fwd
from flash_attn_ck.core.dropout import keep_mask

B, S_Q, S_K, H, D = 2, 24, 32, 2, 64
DROPOUT_P = 0.25


def capture(fn):
    """Capture `fn` (returning a dict of tensors) in a CUDA graph; returns (graph, static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):      # warm up: Triton compilation and autotuning must not be captured
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static


def replays(fn, device, count=2):
    """`count` runs of `fn`: graph replays on CUDA, plain calls elsewhere. Results are copies."""
    if device == "cpu":
        return [{name: t.clone() for name, t in fn().items()} for _ in range(count)]
    graph, static = capture(fn)
    results = []
    for _ in range(count):
        graph.replay()
        torch.cuda.synchronize()
        results.append({name: t.clone() for name, t in static.items()})
    return results


def dropout_inputs(device, dtype):
    """Random q/k/dout; v = [identity | random] so out[..., :S_K] shows the dropout pattern."""
    torch.manual_seed(0)
    q = 0.5 * torch.randn(B, S_Q, H, D, device=device, dtype=dtype)
    k = 0.5 * torch.randn(B, S_K, H, D, device=device, dtype=dtype)
    v = torch.randn(B, S_K, H, D, device=device, dtype=dtype)
    v[..., :S_K] = torch.eye(S_K, device=device, dtype=dtype)[None, :, None, :]
    dout = torch.randn(B, S_Q, H, D, device=device, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)], dout


def keep_from_out(out: torch.Tensor) -> torch.Tensor:
    """(b, h, s_q, s_k) keep pattern read from out (see the module docstring)."""
    return (out[..., :S_K] != 0).permute(0, 2, 1, 3)


def keep_from_rng_state(rng_state: torch.Tensor, device) -> torch.Tensor:
    rows, cols, heads = (torch.arange(n, device=device) for n in (S_Q, S_K, H))
    seed_offset = tuple(rng_state.tolist())
    return torch.stack([keep_mask(seed_offset, DROPOUT_P, b, H, heads, rows, cols) for b in range(B)])


def dense_attention_grads(q, k, v, dout, keep):
    """fp32 attention with the given keep pattern: out, dq, dk, dv."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    probs = torch.einsum("bqhd,bkhd->bhqk", q, k).mul(D ** -0.5).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs * keep / (1 - DROPOUT_P), v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.float())
    return dict(out=out, dq=dq, dk=dk, dv=dv)


def check_dropout_replays(path, device, dtype, backend, tol):
    (q, k, v), dout = dropout_inputs(device, dtype)

    def autograd_step():            # the public function and the op's registered autograd
        out = flash_attn_func(q, k, v, DROPOUT_P, backend=backend)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        return dict(out=out, dq=dq, dk=dk, dv=dv)

    def low_level_step():           # forward and backward ops, the rng_state passed between them
        out, lse, rng_state = flash_attn_fwd(q, k, v, dropout_p=DROPOUT_P, backend=backend)
        dq, dk, dv, _ = flash_attn_bwd(dout, q, k, v, out, lse, dropout_p=DROPOUT_P, rng_state=rng_state,
                                       backend=backend)
        return dict(out=out, dq=dq, dk=dk, dv=dv, rng_state=rng_state)

    with torch.no_grad() if path == "low_level" else torch.enable_grad():
        results = replays(autograd_step if path == "autograd" else low_level_step, device)

    keeps = [keep_from_out(r["out"]) for r in results]
    for result, keep in zip(results, keeps):
        dropped = 1 - keep.float().mean().item()
        assert abs(dropped - DROPOUT_P) < 0.05, f"dropped fraction {dropped:.3f}, expected {DROPOUT_P}"
        if path == "low_level":
            assert torch.equal(keep, keep_from_rng_state(result["rng_state"], device))
        # The backward used the forward's pattern: every gradient matches the dense attention with it.
        for name, expected in dense_attention_grads(q, k, v, dout, keep).items():
            torch.testing.assert_close(result[name].float(), expected, atol=tol, rtol=tol,
                                       msg=lambda m: f"{name}: {m}")
    # Each replay drew a fresh pattern (two independent draws differ in ~2p(1-p) = 37% of the entries).
    assert (keeps[0] != keeps[1]).float().mean() > 0.2
    if path == "low_level":
        assert not torch.equal(results[0]["rng_state"], results[1]["rng_state"])
