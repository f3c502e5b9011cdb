"""Host µs of the replayed Triton launch path on the CPU (triton backend: replay.py, launch.py, `_replayed`).

What a replayed eager call pays in the Triton backend besides the launcher itself, for b1 s128 h16 d128 bf16 dense
(the H200 host table's shapes, bench/nvidia-h200.md, as CPU tensors): `replay.layout_key` of the forward's and the
backward's tensors (and of a varlen forward, whose cu_seqlens share one tensor); the fill of each recorded launch's
arguments (`_Launch.fill`, `_Args.fill` before it) for the forward's attn_fwd_kernel and the backward's bwd_preprocess
and bwd_main, built by launch.py's own spec builders; `Replay.run` of the forward and the backward;
`launch.current_device_and_stream`; `launch.hooked`; and the whole `_replayed` wrapper of a forward and a backward (a
recorded replay of the same launches). There is no GPU: the kernels are fakes with the real kernels' parameter flags
whose launcher is a C no-op, `Tensor.is_cuda` is patched to True, and triton's driver is a `DriverConfig` over the
functions triton's CUDA driver holds (`torch.cuda.current_device`, `torch._C._cuda_getCurrentRawStream`) with torch's
CUDA state faked as initialised (`_cuda_getDevice` and the raw stream query replaced by C builtins), so each row is
the Python around them. Each row: fastest of `--rounds` rounds of `--calls` calls, every row once per round. To
compare two trees, run it once per tree, alternating:

    PYTHONPATH=<tree> python scripts/lab/replay_host_cpu.py [--rounds 30 --calls 2000]
"""

from __future__ import annotations

import argparse
import timeit
import types

import torch

B, S, H, D = 1, 128, 16, 128


def fake_cuda_state():
    """torch's Python CUDA layer as on an initialised CUDA build; the C queries it ends in are C builtins."""
    torch.cuda._initialized = True
    torch.cuda._is_in_bad_fork = bool          # bool() -> False, in C as on a CUDA build
    torch._C._cuda_getDevice = int             # int() -> 0
    torch._C._cuda_getCurrentRawStream = abs   # abs(device) -> 0
    import triton.runtime
    from triton.runtime.driver import DriverConfig
    config = DriverConfig()
    config.set_active(types.SimpleNamespace(get_current_device=torch.cuda.current_device,
                                            get_current_stream=torch._C._cuda_getCurrentRawStream))
    triton.runtime.driver = config
    torch.Tensor.is_cuda = property(lambda self: True)


class FakeKernel:
    """A JITFunction's surface with `kernel`'s parameter flags; its compiled kernel's launcher does nothing (in C)."""

    def __init__(self, kernel):
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        self.params = kernel.params
        self.device_caches = {0: (None, None, None, CUDABackend(GPUTarget("cuda", 90, 32)), None)}
        self.compiled = types.SimpleNamespace(run="".format, function="function", packed_metadata="metadata")

    def __getitem__(self, grid):
        return lambda *args, num_warps, num_stages: self.compiled


def specs():
    """(forward tensors, forward launches, backward tensors, backward launches, workspace): launches as
    (fake kernel, grid, args, warps, stages) from launch.py's builders, as the one-launch kernels take them."""
    from flash_attn_ck.backends.triton import config
    from flash_attn_ck.backends.triton.one_launch.bwd_main import attn_bwd_kernel
    from flash_attn_ck.backends.triton.one_launch.forward import attn_fwd_kernel
    from flash_attn_ck.backends.triton.runtime import launch
    from flash_attn_ck.backends.triton.runtime.bwd_preprocess import bwd_preprocess_kernel
    g = torch.Generator().manual_seed(0)
    q, k, v, out, dout, dq, dk, dv = (torch.randn(B, S, H, D, generator=g).bfloat16() for _ in range(8))
    lse, delta = torch.empty(B, H, S), torch.empty(B, H, S)
    sizes = launch.Sizes(H, 1, S, S, D)
    scores, features = launch.split_named(dict(scale=D ** -0.5, softcap=0.0, dropout_p=0.0, window_left=0,
                                               window_right=0, HAS_RIGHT=True), VARLEN=False, EVEN_K=True)
    tile = config.Tile(128, 64, 8, 3)
    fwd = launch.forward(q, k, v, out, lse, launch.SequenceArgs(lse, lse, lse, lse), sizes, scores, features, tile,
                         128, (1, B * H))
    pre = launch.bwd_preprocess(out, dout, delta, (None, None, None, None), B, sizes, False, 128)
    main = launch.bwd_main(q, k, v, dout, lse, delta, dq, dk, dv, None, None, None,
                           launch.SequenceArgs(delta, delta, delta, delta), B, sizes, scores,
                           features._replace(LOOP_GROUP=True), tile, tile, 128, (4, B * H))
    fakes = {kernel: FakeKernel(kernel) for kernel in (attn_fwd_kernel, bwd_preprocess_kernel, attn_bwd_kernel)}

    def launches(*specs):
        return [(fakes[s.kernel], s.grid, tuple(s.args.values()), s.num_warps, s.num_stages) for s in specs]
    fwd_tensors = (q, k, v, None, None, None, None, out, lse)
    bwd_tensors = (q, k, v, None, None, None, None, out, lse, dout, dq, dk, dv, delta)
    return fwd_tensors, launches(fwd), bwd_tensors, launches(pre, main), {"softmax_d": delta}


def rows():
    from flash_attn_ck.backends.triton import backend
    from flash_attn_ck.backends.triton.runtime import launch, replay
    fwd_tensors, fwd_launches, bwd_tensors, bwd_launches, workspace = specs()

    def method(launches):
        def issue():
            for kernel, grid, args, warps, stages in launches:
                launch.launch_kernel(kernel, grid, args, warps, stages)
        return issue
    fwd_replay = replay.record(method(fwd_launches), fwd_tensors)
    bwd_replay = replay.record(method(bwd_launches), bwd_tensors)
    assert fwd_replay is not None and bwd_replay is not None
    # what rebuilds one launch's arguments: `_Launch.fill` (flattened), before it `_Args.fill` of its arguments
    fwd_fill = [getattr(x, "fill", None) or x.args.fill for x in fwd_replay.launches]
    bwd_fill = [getattr(x, "fill", None) or x.args.fill for x in bwd_replay.launches]
    cu = torch.tensor([0, 40, 128], dtype=torch.int32)
    varlen = (*(t.view(B * S, H, D) for t in fwd_tensors[:3]), cu, cu, None, None,
              fwd_tensors[7].view(B * S, H, D), fwd_tensors[8].view(H, B * S))

    class Backend:      # the wrapper over methods that launch what the real ones would
        @backend._replayed
        def forward(self, p, params, out, lse):
            method(fwd_launches)()

        @backend._replayed
        def backward(self, p, params, out, lse, dout, dq, dk, dv, workspace):
            method(bwd_launches)()

    q, k, v = fwd_tensors[:3]
    params = types.SimpleNamespace(q=q, k=k, v=v, cu_seqlens_q=None, cu_seqlens_k=None, alibi_slopes=None,
                                   rng_state=None)
    problem = types.SimpleNamespace(memo={})
    be = Backend()
    out, lse, dout, dq, dk, dv = bwd_tensors[7:13]
    for _ in range(2):      # recorded, then replayed
        be.forward(problem, params, out, lse)
        be.backward(problem, params, out, lse, dout, dq, dk, dv, workspace)
    assert all(len(x) == 1 and None not in x.values() for x in problem.memo.values()), problem.memo
    return {
        "layout_key, forward (9 roles)": lambda: replay.layout_key(fwd_tensors),
        "layout_key, backward (14 roles)": lambda: replay.layout_key(bwd_tensors),
        "layout_key, varlen forward (shared cu_seqlens)": lambda: replay.layout_key(varlen),
        "fill, attn_fwd_kernel": lambda: fwd_fill[0](fwd_tensors),
        "fill, bwd_preprocess": lambda: bwd_fill[0](bwd_tensors),
        "fill, bwd_main": lambda: bwd_fill[1](bwd_tensors),
        "Replay.run, forward": lambda: fwd_replay.run(fwd_tensors),
        "Replay.run, backward": lambda: bwd_replay.run(bwd_tensors),
        "current_device_and_stream": launch.current_device_and_stream,
        "hooked": launch.hooked,
        "_replayed forward (key, lookup, replay)": lambda: be.forward(problem, params, out, lse),
        "_replayed backward (key, lookup, replay)":
            lambda: be.backward(problem, params, out, lse, dout, dq, dk, dv, workspace),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fake_cuda_state()
    table = rows()
    best = dict.fromkeys(table, float("inf"))
    for _ in range(args.rounds):        # every row once per round: a busy interval slows all rows alike
        for name, call in table.items():
            best[name] = min(best[name], timeit.timeit(call, number=args.calls) / args.calls * 1e6)
    for name, us in best.items():
        print(f"{us:8.2f} µs  {name}")


if __name__ == "__main__":
    main()
