"""CUDA graph capture and replay of forward + backward (GPU, Triton backend), with and without dropout.

Dropout under capture: `rng_state` is drawn on the device by torch.randint, which the captured graph
re-draws on every replay, so two replays must drop different entries, and each replay's forward and
backward must use one and the same pattern. The pattern is read back two ways:
- from `out`: v's first s_k columns are the identity, so out[..., :s_k] is the dropped-and-rescaled
  probability matrix and is zero exactly where an entry was dropped (softmax probabilities are > 0);
- from the returned `rng_state`, through the keep-pattern definition in core/dropout.py.
Each replay's out and gradients are then compared with a dense fp32 attention using that pattern.

The checks live in dropout_replays.py; tests/api/test_dropout_replays.py runs them eagerly on the CPU with the
reference backend (no capture), which keeps the oracle honest where no GPU is available.
"""

from __future__ import annotations

import pytest
import torch

from dropout_replays import DROPOUT_P, S_K, S_Q, B, D, capture, check_dropout_replays, dropout_inputs, replays
from flash_attn_ck import flash_attn_bwd, flash_attn_func, flash_attn_fwd, flash_attn_varlen_func

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# ---- without dropout: replays match eager on fresh inputs -------------------------------------------

@gpu
@requires_cuda
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_replay_matches_eager(varlen):
    torch.manual_seed(0)
    lengths = [5, 17, 9]
    shape_q = (sum(lengths), 4) if varlen else (B, S_Q, 4)
    shape_k = (sum(lengths), 2) if varlen else (B, S_K, 2)
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)

    def randn(*shape):
        return torch.randn(*shape, D, device="cuda", dtype=torch.float16)

    q, k, v = randn(*shape_q).requires_grad_(), randn(*shape_k).requires_grad_(), randn(*shape_k).requires_grad_()
    dout = randn(*shape_q)

    def step():         # GQA, causal
        if varlen:
            out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, backend="triton")
        else:
            out = flash_attn_func(q, k, v, causal=True, backend="triton")
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        return dict(out=out, dq=dq, dk=dk, dv=dv)

    graph, static = capture(step)
    for _ in range(2):
        # New data in the static inputs: a replay must compute on it, as eager does.
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(torch.randn_like(t))
        graph.replay()
        eager = step()
        for name, expected in eager.items():
            torch.testing.assert_close(static[name], expected, atol=2e-3, rtol=2e-3, msg=lambda m: f"{name}: {m}")


@gpu
@requires_cuda
def test_compiled_cudagraphs_match_eager():
    """torch.compile(mode="reduce-overhead"): inductor captures the op (forward and backward) in its
    own CUDA graphs; from the third call on, calls are replays."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    w = (torch.randn(D, 3 * 4 * D, device="cuda") * D ** -0.5).half().requires_grad_()

    def model(x):
        q, k, v = (x @ w).unflatten(-1, (3, 4, D)).unbind(-3)
        return flash_attn_func(q, k, v, causal=True, backend="triton").sum(-2)

    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        x = torch.randn(B, S_Q, D, device="cuda", dtype=torch.float16, requires_grad=True)
        dout = torch.randn(B, S_Q, D, device="cuda", dtype=torch.float16)
        results = []
        for fn in (model, compiled):
            out = fn(x)
            grads = torch.autograd.grad(out, (x, w), dout)
            results.append([t.clone() for t in (out, *grads)])     # replays overwrite graph outputs
        for name, eager, replayed in zip(("out", "dx", "dw"), *results):
            torch.testing.assert_close(replayed, eager, atol=1e-2, rtol=1e-2, msg=lambda m: f"{name}: {m}")
    assert counters["inductor"]["cudagraph_skips"] == 0


# ---- with dropout: fresh, self-consistent patterns on every replay -----------------------------------

@gpu
@requires_cuda
@pytest.mark.parametrize("path", ["autograd", "low_level"])
def test_dropout_replays_are_fresh_and_consistent(path):
    check_dropout_replays(path, "cuda", torch.float16, "triton", tol=1e-2)


@gpu
@requires_cuda
def test_dropout_replay_backward_matches_reference_backend():
    """The captured Triton backward and the reference backward agree for each replay's rng_state."""
    (q, k, v), dout = dropout_inputs("cuda", torch.float16)
    q, k, v = (t.detach() for t in (q, k, v))

    def step():
        out, lse, rng_state = flash_attn_fwd(q, k, v, dropout_p=DROPOUT_P, backend="triton")
        dq, dk, dv, _ = flash_attn_bwd(dout, q, k, v, out, lse, dropout_p=DROPOUT_P, rng_state=rng_state,
                                       backend="triton")
        return dict(out=out, lse=lse, rng_state=rng_state, dq=dq, dk=dk, dv=dv)

    for r in replays(step, "cuda"):
        expected = flash_attn_bwd(dout, q, k, v, r["out"], r["lse"], dropout_p=DROPOUT_P,
                                  rng_state=r["rng_state"], backend="reference")
        for name, grad in zip(("dq", "dk", "dv"), expected[:3]):
            torch.testing.assert_close(r[name], grad, atol=1e-2, rtol=1e-2, msg=lambda m: f"{name}: {m}")
