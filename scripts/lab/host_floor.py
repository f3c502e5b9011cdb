"""The floor of a host path in Python on this machine: µs per call of the primitives one attention call
is built from (an allocation, a trivial autograd Function, the autograd engine, a Triton launch through
the compiled kernel's launcher, Triton's per-argument specialisation), beside SDPA flash (FA2).
Fastest of 5 x `--calls` back-to-back calls, no sync inside the loop.

    python scripts/lab/host_floor.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def best_us(call, calls: int) -> float:
    for _ in range(50):
        call()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return best


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(1, 16, 128, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    leaf = torch.randn(8, device=device, requires_grad=True)
    rows = {
        "torch.empty (1 MiB)": lambda: torch.empty(1 << 19, device=device, dtype=torch.bfloat16),
        "torch.empty_like": lambda: torch.empty_like(q),
        "tensor.stride()": lambda: q.stride(),
        "tensor.data_ptr()": lambda: q.data_ptr(),
        "trivial Function.apply (grad)": lambda: Identity.apply(leaf),
        "trivial Function fwd+autograd.grad": lambda: torch.autograd.grad(Identity.apply(leaf), (leaf,),
                                                                          torch.ones_like(leaf)),
    }
    if device == "cuda":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt = q.detach()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            rows["SDPA flash forward, no grad"] = lambda: F.scaled_dot_product_attention(qt, qt, qt, is_causal=True)
        import triton
        import triton.language as tl
        from triton.runtime import driver
        from triton.runtime.jit import native_specialize_impl

        @triton.jit
        def small(X, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(X + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)

        x = torch.zeros(64, device=device)
        small[(1,)](x, 64, BLOCK=64)
        dev = driver.active.get_current_device()
        backend = small.device_caches[dev][3]
        rows["triton kernel[grid](...) (2 args)"] = lambda: small[(1,)](x, 64, BLOCK=64)
        from flash_attn_ck.backends.triton.runtime.launch import launch_kernel
        rows["launch.launch_kernel (2 args)"] = lambda: launch_kernel(small, (1,), (x, 64, 64), 4, 3)
        rows["native_specialize_impl (tensor)"] = lambda: native_specialize_impl(backend, x, False, True, True)
        rows["native_specialize_impl (int)"] = lambda: native_specialize_impl(backend, 64, False, True, True)
        rows["get_current_stream"] = lambda: driver.active.get_current_stream(dev)
        rows["get_current_device"] = lambda: driver.active.get_current_device()
    if device == "cuda":
        rows.update(captured_launches())
    for name, call in rows.items():
        with torch.no_grad() if "no grad" in name else torch.enable_grad():
            print(f"{name:40s} {best_us(call, args.calls):8.2f} us", flush=True)


def captured_launches() -> dict:
    """Each launch of one small forward + backward (b1 s128 h16 d128 causal, bf16), timed three ways: the whole
    `LaunchSpec.launch`, the key alone (Triton's specialisation of every argument), the compiled kernel's
    launcher alone."""
    from triton.runtime import driver
    from triton.runtime.jit import native_specialize_impl

    import flash_attn_ck as fa
    from flash_attn_ck.backends.triton.runtime import launch
    specs = []
    original = launch.LaunchSpec.launch

    def capture(spec):
        specs.append(spec)
        original(spec)
    q, k, v = (torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    launch.LaunchSpec.launch = capture
    try:
        out = fa.flash_attn_func(q, k, v, causal=True, backend="triton")
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    finally:
        launch.LaunchSpec.launch = original
    rows = {}
    dev = driver.active.get_current_device()
    for spec in specs:
        name = spec.kernel.__name__
        args = tuple(spec.args.values())
        entry = launch._KERNELS[id(spec.kernel)]
        backend = spec.kernel.device_caches[dev][3]
        compiled = next(iter(entry.compiled.values()))
        stream = driver.active.get_current_stream(dev)
        grid = tuple(spec.grid) + (1,) * (3 - len(spec.grid))
        rows[f"{name}: LaunchSpec.launch ({len(args)} args)"] = spec.launch
        rows[f"{name}: key alone"] = lambda args=args, entry=entry, backend=backend: [
            a if c else native_specialize_impl(backend, a, ic, sp, al)
            for a, (c, ic, sp, al) in zip(args, entry.params)]
        rows[f"{name}: launcher alone"] = lambda args=args, compiled=compiled, grid=grid, stream=stream: compiled.run(
            *grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
    return rows


if __name__ == "__main__":
    main()
