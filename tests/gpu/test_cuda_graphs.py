"""CUDA graph capture and replay of forward + backward (GPU, Triton backend), with and without dropout.

Dropout under capture: `rng_state` is drawn on the device by torch.randint, which the captured graph
re-draws on every replay, so two replays must drop different entries, and each replay's forward and
backward must use one and the same pattern. The pattern is read back two ways:
- from `out`: v's first s_k columns are the identity, so out[..., :s_k] is the dropped-and-rescaled
  probability matrix and is zero exactly where an entry was dropped (softmax probabilities are > 0);
- from the returned `rng_state`, through the keep-pattern definition in core/dropout.py.
Each replay's out and gradients are then compared with a dense fp32 attention using that pattern.

The same checks run eagerly on the CPU with the reference backend (no capture), which keeps the
oracle honest where no GPU is available.
"""

from __future__ import annotations

import pytest
import torch

from flash_attn_ck import flash_attn_bwd, flash_attn_func, flash_attn_fwd, flash_attn_varlen_func
from flash_attn_ck.core.dropout import keep_mask

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

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


@pytest.mark.parametrize("path", ["autograd", "low_level"])
def test_dropout_checks_on_cpu(path):
    """The dropout oracle on the CPU reference backend, without capture."""
    check_dropout_replays(path, "cpu", torch.float32, "reference", tol=1e-5)


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
