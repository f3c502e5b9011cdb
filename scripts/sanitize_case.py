"""The compute-sanitizer case of `scripts/device.sh sanitize`: small Triton backwards under memcheck and
racecheck. A GQA 8/2 d64 varlen call (empty sequences on either side, causal, deterministic) and a dense
GQA one, for each GQA epilogue (with use_tma=True the TMA loads, stores and the bulk reduce-add epilogue
with its semaphores run under the tools); with the defaults also a dense d256 call (its row orders dO V^T
before the exp2, config.Configs.bwd_dp_first) and a dense unwindowed call whose s_k is a multiple of every
key tile (the EVEN_K kernels, TMA tiles).

`python3 scripts/sanitize_case.py ws` runs the warp-specialised kernels (fwd_ws.py, bwd_ws.py) instead: a
causal GQA 8/2 varlen call with empty sequences at d64 (bwd_ws's two-CTAs-per-SM tile), d128 (bwd_ws, key-major
grid) and d256 (bwd_ws_split), deterministic (the backward's semaphore-ordered dQ adds) and not, and a dense
windowed one. `ws-named` runs the same backward calls at d64 and d128 with their table tiles'
config.WsTile.named_barriers (the hand-offs by hardware named barriers), without the forward's.

`python3 scripts/sanitize_case.py ws-switch` runs a Gluon kernel whose two partitions touch no shared memory
of their own (each writes its own global rows): whatever racecheck reports there belongs to the code Triton
generates for gl.warp_specialize (the partition-state bytes its worker warps read after a CTA barrier), and
is the baseline the `ws` case's report is read against.

`python3 scripts/sanitize_case.py handoff` runs bwd_ws's lse/D hand-off pattern alone: a 1-warp partition stores
rows into a 2-slot shared ring with plain stores and publishes each slot through an mbarrier arrive; the 4-warp
partition waits on that mbarrier, reads the slot and hands it back through a second mbarrier; the output is
checked exactly. Whatever racecheck reports there says which correct mbarrier hand-offs it cannot model
(what it reported on the H200: bench/nvidia-h200.md §compute-sanitizer)."""

import sys
from dataclasses import replace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

import flash_attn_ck as fa
from flash_attn_ck.backends.triton import TritonBackend
from flash_attn_ck.backends.triton.config import BWD_WS_SM90

torch.manual_seed(0)


def varlen_backward(lens_q, lens_k, head_dim, deterministic):
    """A causal GQA 8/2 varlen forward + backward through the public API."""
    cu_q = torch.tensor([0, *lens_q]).cumsum(0).int().cuda()
    cu_k = torch.tensor([0, *lens_k]).cumsum(0).int().cuda()
    q = torch.randn(sum(lens_q), 8, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                    deterministic=deterministic, backend="triton")
    out.backward(torch.randn_like(out))


def ws_case(backends):
    """`backends`: {head dim: the TritonBackend that runs its calls}."""
    for head_dim, backend in backends.items():
        with fa.use_backend(backend):
            for deterministic in (True, False):
                varlen_backward([137, 0, 70, 5, 200], [150, 9, 70, 0, 129], head_dim, deterministic)
            if head_dim == 128:
                qd, kd, vd = (torch.randn(2, 300, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                              for h in (4, 2, 2))
                fa.flash_attn_func(qd, kd, vd, window_size=(100, 20), backend="triton").sum().backward()


@gluon.jit
def _fill(out, value, ROW: gl.constexpr, num_warps: gl.constexpr):
    offs = gl.arange(0, 32 * num_warps, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    gl.store(out + ROW * 256 + offs, gl.full([32 * num_warps], value, gl.float32, offs.type.layout))


@gluon.jit
def _switch_kernel(out):
    gl.warp_specialize([(_fill, (out, 1.0, 0, 4)), (_fill, (out, 2.0, 1, 1))], [1], [24])


@gluon.jit
def _handoff_producer(ring, ready, empty, STEPS: gl.constexpr):
    offs = gl.arange(0, 64, layout=gl.BlockedLayout([2], [32], [1], [0]))
    for step in range(STEPS):
        slot = step % 2
        mbarrier.wait(empty.index(slot), ((step // 2) & 1) ^ 1)
        ring.index(slot).store((offs + step * 64).to(gl.float32))
        mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def _handoff_consumer(ring, ready, empty, out, STEPS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 64, layout=layout)
    for step in range(STEPS):
        slot = step % 2
        mbarrier.wait(ready.index(slot), (step // 2) & 1)
        gl.store(out + step * 64 + offs, ring.index(slot).load(layout))
        mbarrier.arrive(empty.index(slot), count=1)


@gluon.jit
def _handoff_kernel(out, STEPS: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.float32, [2, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([(_handoff_consumer, (ring, ready, empty, out, STEPS)),
                        (_handoff_producer, (ring, ready, empty, STEPS))], [1], [24])


def handoff_case():
    out = torch.zeros(16 * 64, device="cuda")
    _handoff_kernel[(1,)](out, STEPS=16, num_warps=4)
    assert torch.equal(out, torch.arange(16 * 64, device="cuda", dtype=torch.float32))


def ws_switch_case():
    out = torch.zeros(2, 256, device="cuda")
    _switch_kernel[(4,)](out, num_warps=4)
    assert (out[0, :128] == 1).all() and (out[1, :32] == 2).all()


if sys.argv[1:] == ["handoff"]:
    handoff_case()
    torch.cuda.synchronize()
    print("case done")
    sys.exit(0)

if sys.argv[1:] == ["ws-switch"]:
    ws_switch_case()
    torch.cuda.synchronize()
    print("case done")
    sys.exit(0)

if sys.argv[1:] == ["ws"]:
    ws_case({head_dim: TritonBackend(ws=True, fwd_ws=True) for head_dim in (64, 128, 256)})
    torch.cuda.synchronize()
    print("case done")
    sys.exit(0)

if sys.argv[1:] == ["ws-named"]:
    ws_case({head_dim: TritonBackend(ws=True, ws_tile=replace(BWD_WS_SM90[head_dim], named_barriers=True))
             for head_dim in (64, 128)})
    torch.cuda.synchronize()
    print("case done")
    sys.exit(0)

for opts in (dict(), dict(gqa_epilogue="accumulate"), dict(gqa_epilogue="accumulate", use_tma=True)):
    with fa.use_backend(TritonBackend(**opts)):
        varlen_backward([37, 0, 70, 5], [50, 9, 70, 0], 64, deterministic=True)
        qd = torch.randn(2, 70, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kd = torch.randn(2, 90, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        vd = torch.randn_like(kd, requires_grad=True)
        fa.flash_attn_func(qd, kd, vd, causal=True, deterministic=True, backend="triton").sum().backward()
        if not opts:
            q2, k2, v2 = (torch.randn(2, 150, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                          for _ in range(3))
            fa.flash_attn_func(q2, k2, v2, causal=True, backend="triton").sum().backward()
            q3, k3, v3 = (torch.randn(1, 2304, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                          for _ in range(3))
            fa.flash_attn_func(q3, k3, v3, backend="triton").sum().backward()
torch.cuda.synchronize()
print("case done")
