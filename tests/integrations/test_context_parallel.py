"""Context parallelism (flash_attn_ck/integrations/context_parallel/) on CPU: gloo, 2, 3 and 4 processes on
localhost (torch.multiprocessing.spawn), reference backend, float64. Every rank checks its shard of the
output and of dq/dk/dv against single-process `flash_attn_func` on the full sequence, for each case, and the
varlen cases (ring, one cu_seqlens, an empty sequence among them) against `flash_attn_varlen_func`; dropout
(each kernel call its own keep pattern) by the directional derivative of the group's loss with the rng fixed;
bf16/fp16 at one-row chunks under the 2x rule; the SDPA-shaped front end on (b, h, s, d) shards cut by torch's
own head-tail load balancer. One spawn per world size runs all cases (a spawn costs seconds of imports).
Also: argument errors raise before any communication and a kernel failing after the exchange started leaves
nothing posted (the group stays usable), empty shards, and the options accepted exactly when `flash_attn_func`
accepts them (hypothesis, a one-process group)."""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import itertools
import math
import os
import socket
import sys
import tempfile
import time
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from flash_attn_ck import ArgumentError, flash_attn_bwd, flash_attn_func, flash_attn_fwd, flash_attn_varlen_func
from flash_attn_ck.integrations import context_parallel as cp
from flash_attn_ck.integrations.context_parallel import (
    a2a,
    allgather,
    context_parallel_attn,
    context_parallel_sdpa,
    ring,
    shard,
    transfers,
    unshard,
)
from tests.oracle import assert_close_2x

# (kv_exchange, layout, causal, window, h, h_k)
CASES = [
    *[(exchange, layout, causal, (-1, -1), h, h_k)
      for exchange, layout, causal, (h, h_k) in itertools.product(("ring", "allgather"), ("zigzag", "contiguous"),
                                                                  (False, True), ((4, 4), (4, 2)))],
    ("allgather", "zigzag", False, (5, 3), 4, 2),
    ("allgather", "zigzag", True, (6, -1), 4, 1),
    ("allgather", "contiguous", False, (-1, 4), 2, 2),
    ("allgather", "zigzag", False, (0, 0), 2, 1),
]
# all-to-all over heads: heads in units of W (h, h_k multiples of the world size)
A2A_CASES = [("a2a", "zigzag", True, (-1, -1), 2, 1), ("a2a", "contiguous", False, (-1, -1), 2, 2),
             ("a2a", "zigzag", False, (5, 2), 2, 1)]
# varlen (ring): (layout, causal, h, h_k); sequence lengths in units of 2W, one of them empty
VARLEN_CASES = list(itertools.product(("zigzag", "contiguous"), (False, True), ((4, 4), (4, 2))))
VARLEN_UNITS = (3, 1, 0, 2)
# dropout: (kv_exchange, layout, causal, window)
DROPOUT_CASES = [("ring", "zigzag", True, (-1, -1)), ("ring", "contiguous", False, (-1, -1)),
                 ("allgather", "zigzag", True, (3, -1)), ("a2a", "zigzag", True, (-1, -1))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, world: int, *args, timeout: float = 300.0) -> None:
    """Run `worker(rank, world, port, *args)` on `world` processes; a hang (a collective never matched) fails
    the test after `timeout` seconds instead of blocking the suite. A worker killed by a signal fails it too, unless
    every rank had passed `teardown`'s barrier (all checks done): then the signal came in torch's teardown of the
    group, which is not what the test checks, and it warns."""
    with tempfile.TemporaryDirectory() as passed_dir, mock.patch.dict(os.environ, {_PASSED_DIR: passed_dir}):
        context = mp.spawn(worker, args=(world, _free_port(), *args), nprocs=world, join=False)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for process in context.processes:
                        process.kill()
                    pytest.fail(f"{worker.__name__} at world {world} did not finish in {timeout:.0f} s "
                                "(a hung collective)")
        except mp.ProcessExitedException as error:
            if len(os.listdir(passed_dir)) < world:
                raise
            warnings.warn(f"{worker.__name__} at world {world}: every rank passed its checks, then rank "
                          f"{error.error_index} ended by {error.signal_name} in the group's teardown", stacklevel=2)


# The folder where each rank that passed its checks leaves a file (`teardown`), named in the workers' environment.
_PASSED_DIR = "FLASH_ATTN_CK_TEST_PASSED_DIR"


def init(rank: int, world: int, port: int) -> None:
    faulthandler.enable(all_threads=True)       # a worker that dies by a signal prints where its threads were
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def every_exchange(rank: int, world: int, port: int, cases, check_dense, check_varlen, check_hybrid) -> None:
    """A `spawn` worker for a feature's context-parallel tests: each case on the dense exchanges, the first compiled
    too, then varlen and the hybrid a2a+ring (`check_*` take the world size)."""
    init(rank, world, port)
    try:
        for case in cases:
            check_dense(case, world)
        check_dense(cases[0], world, compiled=True)
        check_varlen(world)
        check_hybrid(world)
    finally:
        teardown()


def teardown() -> None:
    """A worker's `finally`: after a successful run the ranks meet at a barrier before any destroys the group (a rank
    that exited while another was still in a collective made gloo abort that one), each says it passed (`spawn`
    reads it), then the process ends without
    the interpreter's finalization, where a worker was seen to abort ("terminate called without an active exception",
    SIGABRT) after every check had passed, on loaded 2-core CI hosts (the likeliest cause: a C++ thread of torch
    still holding a Python object takes the GIL from the finalizing interpreter, which ends the thread by a forced
    unwind through a noexcept frame). After an error no barrier (the other ranks may never reach it) and a normal
    exit, so that spawn reports the error."""
    if sys.exc_info()[0] is not None:
        dist.destroy_process_group()
        return
    dist.barrier()
    rank = dist.get_rank()
    with open(os.path.join(os.environ[_PASSED_DIR], str(rank)), "w"):
        pass
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _full_inputs(seq, h, h_k, d=16, b=2, dtype=torch.float64, seed=None):
    g = torch.Generator().manual_seed(seq * 31 + h * 7 + h_k if seed is None else seed)
    q = torch.randn(b, seq, h, d, generator=g).to(dtype)
    k, v = (torch.randn(b, seq, h_k, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(b, seq, h, d, generator=g).to(dtype)


def _check_case(case, world):
    exchange, layout, causal, window, h, h_k = case
    seq = 8 * world
    q, k, v, dout = _full_inputs(seq, h, h_k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attn_func(*leaves, causal=causal, window_size=window, softmax_scale=0.4, backend="reference")
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    local = [shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attn(*local, causal=causal, window_size=window, softmax_scale=0.4, layout=layout,
                                kv_exchange=exchange, backend="reference")
    grads = torch.autograd.grad(out, local, shard(dout, layout=layout))
    torch.testing.assert_close(out, shard(ref, layout=layout), atol=1e-12, rtol=1e-10, msg=lambda m: f"{case} out: {m}")
    for name, grad, expected in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, shard(expected, layout=layout), atol=1e-12, rtol=1e-10,
                                   msg=lambda m, name=name: f"{case} {name}: {m}")
    torch.testing.assert_close(unshard(out.detach(), layout=layout), ref.detach(), atol=1e-12, rtol=1e-10)


def _check_varlen_case(case, world):
    layout, causal, (h, h_k) = case
    cu = torch.tensor([0, *itertools.accumulate(2 * world * n for n in VARLEN_UNITS)], dtype=torch.int32)
    total, max_len = int(cu[-1]), 2 * world * max(VARLEN_UNITS)
    g = torch.Generator().manual_seed(world * 13 + h_k + 2 * causal)
    q, dout = (torch.randn(total, h, 16, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(total, h_k, 16, dtype=torch.float64, generator=g) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attn_varlen_func(*leaves, cu, cu, max_len, max_len, causal=causal, softmax_scale=0.4,
                                 backend="reference")
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    cut = dict(seq_dim=0, layout=layout, cu_seqlens=cu)
    local = [shard(t, **cut).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attn(*local, cu_seqlens=cu, causal=causal, softmax_scale=0.4, layout=layout,
                                backend="reference")
    grads = torch.autograd.grad(out, local, shard(dout, **cut))
    for name, ours, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(ours, shard(expected.detach(), **cut), atol=1e-12, rtol=1e-10,
                                   msg=lambda m, name=name: f"varlen {case} {name}: {m}")
    torch.testing.assert_close(unshard(out.detach(), **cut), ref.detach(), atol=1e-12, rtol=1e-10)


def _group_sum(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def _check_dropout_case(case, world):
    """With the rng fixed (the same torch seed before every forward), the group's loss L = sum <dout, out> is a
    function of q, k, v; its directional derivative must equal sum <grads, direction> (a backward that dropped
    other elements than the forward, as torch's own ring does, fails this), the forward must be reproducible,
    and dropout must change the output."""
    exchange, layout, causal, window = case
    q, k, v, dout = (shard(t, layout=layout) for t in _full_inputs(4 * world, 2 * world, world, seed=world))
    directions = [torch.randn_like(t) for t in (q, k, v)]
    run = dict(causal=causal, window_size=window, layout=layout, kv_exchange=exchange, backend="reference")

    def loss(shift, dropout_p=0.3):
        torch.manual_seed(1234)
        out = context_parallel_attn(*(t + shift * d for t, d in zip((q, k, v), directions)), dropout_p=dropout_p, **run)
        return _group_sum((out * dout).sum().item()), out

    torch.manual_seed(1234)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attn(*leaves, dropout_p=0.3, **run)
    grads = torch.autograd.grad(out, leaves, dout)
    predicted = _group_sum(sum((g * d).sum().item() for g, d in zip(grads, directions)))
    eps = 1e-6
    measured = (loss(eps)[0] - loss(-eps)[0]) / (2 * eps)
    assert math.isclose(measured, predicted, rel_tol=1e-6, abs_tol=1e-6), (case, measured, predicted)
    assert torch.equal(loss(0.0)[1], out.detach()), "the same seed draws the same patterns"
    assert not torch.allclose(loss(0.0, dropout_p=0.0)[1], out.detach()), "dropout dropped nothing"


# Explicit examples of `_check_one_row_chunks`: (seed, dtype, exchange, causal, gqa, head dim, batch) that exceeded
# the 2x rule when the steps' results came back in the input dtype (rounded once per step, again after the merge).
ROUNDED_STEPS = [(606, torch.bfloat16, "ring", False, False, 8, 1), (28, torch.float16, "ring", True, False, 32, 1),
                 (8, torch.float16, "allgather", True, True, 16, 2)]


def _check_one_row_chunks(world):
    """bf16/fp16 with one row per chunk (s = 2W), hypothesis over seeds, shapes, exchanges, causal or not, GQA: out and
    every gradient within 2x of the same-precision math SDPA's error against float64. The steps' partial outputs and
    dK/dV come back in fp32 (out_dtype), are merged and added in fp32 and rounded once. Every rank draws the same
    examples (derandomized) and the verdict is the group's (all-reduced), so the ranks stay in step."""

    def ours(q, k, v, exchange, causal):
        return context_parallel_attn(q, k, v, causal=causal, kv_exchange=exchange, backend="reference")

    def sdpa(q, k, v, exchange, causal):
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal,
                                              enable_gqa=True).transpose(1, 2)

    def run(fn, dtype, tensors, *options):
        leaves = [t.to(dtype).requires_grad_() for t in tensors[:3]]
        out = fn(*leaves, *options)
        return (out, *torch.autograd.grad(out, leaves, tensors[3].to(dtype)))

    def check(seed, dtype, exchange, causal, gqa, d, b):
        full = _full_inputs(2 * world, 2 * world, world if gqa else 2 * world, d=d, b=b, dtype=torch.float32,
                            seed=seed)
        ref, same = run(sdpa, torch.float64, full, exchange, causal), run(sdpa, dtype, full, exchange, causal)
        result = run(ours, dtype, [shard(t) for t in full], exchange, causal)
        failures = []
        for name, o, r, p in zip(("out", "dq", "dk", "dv"), result, ref, same, strict=True):
            try:
                assert_close_2x(name, o, shard(r), shard(p))
            except AssertionError as error:
                failures.append(str(error))
        every_rank = [None] * world
        dist.all_gather_object(every_rank, failures)
        assert not any(every_rank), f"world {world}: " + "; ".join(f"rank {r}: {m}" for r, f in enumerate(every_rank)
                                                                  for m in f)

    strategies = dict(seed=st.integers(0, 2 ** 16), dtype=st.sampled_from((torch.bfloat16, torch.float16)),
                      exchange=st.sampled_from(("ring", "allgather", "a2a")), causal=st.booleans(),
                      gqa=st.booleans(), d=st.sampled_from((8, 16, 32, 64)), b=st.integers(1, 2))
    for case in ROUNDED_STEPS:
        check = example(**dict(zip(strategies, case, strict=True)))(check)
    settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
             phases=(Phase.explicit, Phase.generate))(given(**strategies)(check))()


def _check_sdpa_front_end(world):
    """(b, h, s, d) shards cut by torch's `_HeadTailLoadBalancer` (torch's CP sharding) are our zigzag shards, and
    context_parallel_sdpa on them equals SDPA on the full sequence (causal, GQA with enable_gqa), for a positive,
    a negative and a zero scale (SDPA takes any finite one)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._attention import _context_parallel_shard
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (world,))
    seq = 4 * world
    q, k, v, dout = (t.transpose(1, 2).contiguous() for t in _full_inputs(seq, 2 * world, world))
    balancer = _HeadTailLoadBalancer(seq, world, torch.device("cpu"))
    local = _context_parallel_shard(mesh, [q, k, v, dout], [2, 2, 2, 2], load_balancer=balancer)
    for ours, theirs in zip((shard(t, mesh, seq_dim=2) for t in (q, k, v, dout)), local, strict=True):
        assert torch.equal(ours, theirs), "torch's head-tail shard is our zigzag shard"
    for exchange, scale in itertools.product(("ring", "allgather", "a2a"), (0.3, -0.7, 0.0)):
        leaves = [t.clone().requires_grad_() for t in local[:3]]
        out = context_parallel_sdpa(*leaves, mesh, is_causal=True, scale=scale, enable_gqa=True, kv_exchange=exchange,
                                    backend="reference")
        grads = torch.autograd.grad(out, leaves, local[3])
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):      # torch's CPU flash kernel returns nan for a causal scale <= 0
            ref = F.scaled_dot_product_attention(*full, is_causal=True, scale=scale, enable_gqa=True)
        ref_grads = torch.autograd.grad(ref, full, dout)
        for name, o, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
            torch.testing.assert_close(o, shard(r.detach(), mesh, seq_dim=2), atol=1e-12, rtol=1e-10,
                                       msg=lambda m, name=name: f"sdpa front end {exchange} scale {scale} {name}: {m}")
    with pytest.raises(ArgumentError, match="enable_gqa"):
        context_parallel_sdpa(*local[:3], mesh, is_causal=True)


def _check_hybrid(world):
    """a2a+ring over a 2-D mesh (2 ring groups x world/2 a2a ranks): every rank's shard of out, dq, dk, dv equals
    single-process attention (causal zigzag GQA, non-causal contiguous), and dropout's gradients belong to its
    forward (the directional derivative)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ring", "a2a"))
    for layout, causal, h, h_k in (("zigzag", True, 4, 2), ("contiguous", False, 2, 2)):
        q, k, v, dout = _full_inputs(4 * world, h * world // 2, h_k * world // 2)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = flash_attn_func(*full, causal=causal, softmax_scale=0.4, backend="reference")
        ref_grads = torch.autograd.grad(ref, full, dout)
        local = [shard(t, mesh, layout=layout).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attn(*local, mesh, causal=causal, softmax_scale=0.4, layout=layout,
                                    kv_exchange="a2a+ring", backend="reference")
        grads = torch.autograd.grad(out, local, shard(dout, mesh, layout=layout))
        for name, o, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
            torch.testing.assert_close(o, shard(r.detach(), mesh, layout=layout), atol=1e-12, rtol=1e-10,
                                       msg=lambda m, name=name: f"a2a+ring {layout} {name}: {m}")
    q, k, v, dout = (shard(t, mesh) for t in _full_inputs(4 * world, world, world))
    directions = [torch.randn_like(t) for t in (q, k, v)]

    def loss(shift):
        torch.manual_seed(5)
        out = context_parallel_attn(*(t + shift * d for t, d in zip((q, k, v), directions)), mesh, causal=True,
                                    dropout_p=0.3, kv_exchange="a2a+ring", backend="reference")
        return _group_sum((out * dout).sum().item())

    torch.manual_seed(5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attn(*leaves, mesh, causal=True, dropout_p=0.3, kv_exchange="a2a+ring", backend="reference")
    predicted = _group_sum(sum((g * d).sum().item() for g, d in zip(torch.autograd.grad(out, leaves, dout),
                                                                    directions)))
    measured = (loss(1e-6) - loss(-1e-6)) / 2e-6
    assert math.isclose(measured, predicted, rel_tol=1e-6, abs_tol=1e-6), (measured, predicted)


def _worker(rank, world, port):
    init(rank, world, port)
    try:
        for case in CASES:
            _check_case(case, world)
        for exchange, layout, causal, window, h, h_k in A2A_CASES:
            _check_case((exchange, layout, causal, window, h * world, h_k * world), world)
        for case in VARLEN_CASES:
            _check_varlen_case(case, world)
        for case in DROPOUT_CASES:
            _check_dropout_case(case, world)
        _check_one_row_chunks(world)
        _check_sdpa_front_end(world)
        if world % 2 == 0:
            _check_hybrid(world)
    finally:
        teardown()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_context_parallel_matches_single_process(world):
    spawn(_worker, world)


def _bad_calls(q, k, v):
    """Calls that every rank makes with the same wrong argument; each must raise before communicating."""
    yield "softmax_scale", dict(softmax_scale=-1.0)
    yield "window_size", dict(window_size=(1.5, 0), kv_exchange="allgather")
    yield "causal", dict(causal="yes")
    yield "dropout_p", dict(dropout_p=1.5)
    yield "k: expected the dtype", dict(k=k.float())
    yield "head dim", dict(q=torch.zeros(*q.shape[:-1], 300, dtype=q.dtype), k=torch.zeros(*k.shape[:-1], 300,
                                                                                          dtype=k.dtype))
    # h - 1 key heads divide neither h (2W) nor, for the all-to-all, W
    yield "number of key/value heads|heads must be multiples", dict(k=k[:, :, :-1], v=v[:, :, :-1])
    yield "backend", dict(backend="no such backend")


# Every communication context parallelism makes (the module calls them through `dist` at call time).
_COMMUNICATION = ("batch_isend_irecv", "all_gather", "all_to_all_single", "reduce_scatter_tensor")


class _RecordedWork:
    """A posted transfer's work, remembering whether anything waited for it."""

    def __init__(self, work):
        self.work, self.waited = work, False

    def wait(self, *args):
        self.waited = True
        return self.work.wait(*args)


@contextlib.contextmanager
def _recorded_communication():
    """(calls, works): the names of the communication calls made inside, and the works they returned."""
    calls, works = [], []

    def recording(name, communicate):
        def call(*args, **kwargs):
            calls.append(name)
            result = communicate(*args, **kwargs)
            if result is None:          # a blocking collective
                return None
            recorded = [_RecordedWork(w) for w in (result if isinstance(result, list) else [result])]
            works.extend(recorded)
            return recorded if isinstance(result, list) else recorded[0]
        return call

    with contextlib.ExitStack() as stack:
        for name in _COMMUNICATION:
            stack.enter_context(mock.patch.object(dist, name, recording(name, getattr(dist, name))))
        yield calls, works


def _failing_kernel(kernel):
    """`kernel` (flash_attn_fwd or _bwd as every exchange module calls it) that raises on its first call."""
    def call(*args, **kwargs):
        raise RuntimeError(f"injected failure of {kernel.__name__}")
    stack = contextlib.ExitStack()
    for module in (ring, allgather, a2a):
        stack.enter_context(mock.patch.object(module, kernel.__name__, call))
    return stack


def _assert_group_usable(world, after):
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == world, f"the group is unusable after {after}"


def _error_worker(rank, world, port):
    init(rank, world, port)
    try:
        q, k, v, dout = (shard(t) for t in _full_inputs(4 * world, 2 * world, 2 * world))
        for exchange in ("ring", "allgather", "a2a"):
            for expected, change in _bad_calls(q, k, v):
                args = dict(q=q, k=k, v=v, causal=True, kv_exchange=exchange, backend="reference") | change
                with _recorded_communication() as (calls, _), \
                        pytest.raises((ArgumentError, ValueError, RuntimeError), match=expected):
                    context_parallel_attn(args.pop("q"), args.pop("k"), args.pop("v"), **args)
                assert not calls, f"{exchange}: the {expected} error came after communicating: {calls}"
                _assert_group_usable(world, f"the {exchange} {expected} error")
            # A failure after the exchange started (the first kernel call, on every rank): what was posted is waited
            # for before the error propagates.
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            attend = functools.partial(context_parallel_attn, *leaves, causal=True, kv_exchange=exchange,
                                       backend="reference")
            differentiate = functools.partial(torch.autograd.grad, attend(), leaves, dout)
            for kernel, call in ((flash_attn_fwd, attend), (flash_attn_bwd, differentiate)):
                with _recorded_communication() as (calls, works), _failing_kernel(kernel), \
                        pytest.raises(RuntimeError, match="injected failure"):
                    call()
                assert calls, f"{exchange} {kernel.__name__}: nothing was exchanged before the kernel call"
                assert all(work.waited for work in works), f"{exchange} {kernel.__name__}: a transfer left posted"
                _assert_group_usable(world, f"a {exchange} {kernel.__name__} failure")
        out = context_parallel_attn(q, k, v, causal=True, backend="reference")
        ref = flash_attn_func(*(unshard(t) for t in (q, k, v)), causal=True, backend="reference")
        torch.testing.assert_close(out, shard(ref), atol=1e-12, rtol=1e-10)
    finally:
        teardown()


@pytest.mark.parametrize("world", [2, 3])
def test_an_error_on_every_rank_leaves_the_group_usable(world):
    """Argument errors raise before any communication (none is made), on every exchange; a failure after the
    exchange started (the first kernel call of the forward or the backward) waits for what was posted; after each
    the next all-reduce and a valid call work."""
    spawn(_error_worker, world, timeout=180)


def _empty_worker(rank, world, port):
    init(rank, world, port)
    try:
        for exchange, (h, h_k) in itertools.product(("ring", "allgather", "a2a"), ((4, 4), (4, 2))):
            q, k, v, dout = (shard(t) for t in _full_inputs(0, h, h_k))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out, lse = context_parallel_attn(*leaves, causal=True, kv_exchange=exchange, backend="reference",
                                             return_lse=True)
            grads = torch.autograd.grad(out, leaves, dout)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, ref_lse, _ = flash_attn_func(*full, causal=True, backend="reference", return_attn_probs=True)
            ref_grads = torch.autograd.grad(ref, full, dout)
            for ours, expected in zip((out, lse, *grads), (ref, ref_lse, *ref_grads), strict=True):
                assert ours.shape == expected.shape and ours.dtype == expected.dtype
            with _recorded_communication() as (calls, _):
                out = context_parallel_attn(*leaves, causal=True, kv_exchange=exchange, backend="reference")
                out.sum().backward()        # autograd hands the backward an expanded (stride 0) dout
            assert all(t.grad.shape == t.shape and not t.grad.any() for t in leaves)
            assert not calls, f"{exchange}: empty shards exchanged {calls}"
            # The same expanded dout on shards with rows: the gradients of the sum, as single-process attention's.
            q, k, v, _ = _full_inputs(4 * world, h, h_k)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            expected = torch.autograd.grad(flash_attn_func(*full, causal=True, backend="reference").sum(), full)
            leaves = [shard(t).requires_grad_() for t in (q, k, v)]
            context_parallel_attn(*leaves, causal=True, kv_exchange=exchange, backend="reference").sum().backward()
            for name, t, grad in zip("qkv", leaves, expected, strict=True):
                torch.testing.assert_close(t.grad, shard(grad), atol=1e-12, rtol=1e-10, msg=f"{exchange} d{name}")
        q, k, v, _ = (shard(t) for t in _full_inputs(0, 2, 2))
        cu = torch.zeros(3, dtype=torch.int32)
        leaves = [t[0].clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attn(*leaves, cu_seqlens=cu, backend="reference")
        assert all(g.shape == t.shape for g, t in zip(torch.autograd.grad(out.sum(), leaves), leaves))
    finally:
        teardown()


def test_empty_shards_forward_and_backward():
    """s = 0 (every shard empty), dense (every exchange) and varlen: shapes as flash_attn_func gives, no exchange, no
    error, also for the stride-0 dout of `out.sum().backward()`, whose gradients on shards with rows are the
    single-process ones."""
    spawn(_empty_worker, 2, timeout=120)


def test_refusals_without_a_process_group():
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    with pytest.raises(ArgumentError, match="cu_seqlens_q"):
        context_parallel_attn(q, q, q, cu_seqlens_q=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ArgumentError, match="allgather"):
        context_parallel_attn(q, q, q, window_size=(4, 0))
    with pytest.raises(ArgumentError, match="kv_exchange='ring'"):
        context_parallel_attn(q[0], q[0], q[0], cu_seqlens=torch.tensor([0, 8], dtype=torch.int32),
                              kv_exchange="allgather")
    sdpa_q = q.transpose(1, 2)
    for name, operands in (("query", (None, sdpa_q, sdpa_q)), ("key", (sdpa_q, [1.0], sdpa_q)),
                        ("value", (sdpa_q, sdpa_q, q[0]))):
        with pytest.raises(ArgumentError, match=rf"^{name}: expected a \(b, h, s / W, d\) tensor"):
            context_parallel_sdpa(*operands)



def _outcome(fn):
    try:
        return "accepted", fn()
    except ArgumentError as error:
        return "refused", error


# Window sides: small ones, and valid ones near the int32 limit (the all-gather shifts them per rank).
_WINDOW_SIDE = st.one_of(st.integers(-8, 8), st.integers(2**31 - 3, 2**31 - 1))
_ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True, allow_infinity=True),
                 st.sampled_from(["1", "yes", (1,), 1.5]))


@settings(max_examples=60, deadline=None)
@example(softmax_scale=None, causal=False, window_size=(2**31 - 1, -1), dropout_p=0.0, deterministic=False)
# The adversarial round's: a window side truncated, negative sides other than -1 read as unbounded, a string causal.
@example(softmax_scale=None, causal=False, window_size=(1.5, 0), dropout_p=0.0, deterministic=False)
@example(softmax_scale=None, causal=False, window_size=(-2, 0), dropout_p=0.0, deterministic=False)
@example(softmax_scale=None, causal=False, window_size=(-1, -7), dropout_p=0.0, deterministic=False)
@example(softmax_scale=None, causal="yes", window_size=(-1, -1), dropout_p=0.0, deterministic=False)
@given(softmax_scale=st.one_of(st.none(), st.floats(-2, 2), _ANY),
       causal=st.one_of(st.booleans(), _ANY),
       window_size=st.one_of(st.tuples(_WINDOW_SIDE, _WINDOW_SIDE),
                             st.tuples(st.one_of(st.integers(-3, 3), _ANY), st.one_of(st.integers(-3, 3), _ANY)),
                             st.lists(st.integers(-1, 3), max_size=3), _ANY),
       dropout_p=st.one_of(st.just(0.0), st.floats(-0.5, 1.5), _ANY),
       deterministic=st.one_of(st.booleans(), _ANY))
def test_options_accepted_exactly_when_flash_attn_func_accepts_them(one_process_group, softmax_scale, causal,
                                                                    window_size, dropout_p, deterministic):
    """One validation for both: every option value is refused by context_parallel_attn (ArgumentError, before any
    communication) exactly when flash_attn_func refuses it, and an accepted call without dropout gives the
    same result (a one-process group)."""
    q, k, v, _ = _full_inputs(4, 2, 1, d=8, b=1)
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, dropout_p=dropout_p,
                   deterministic=deterministic)
    single = _outcome(lambda: flash_attn_func(q, k, v, backend="reference", **options))
    ours = _outcome(lambda: context_parallel_attn(q, k, v, kv_exchange="allgather", backend="reference", **options))
    assert ours[0] == single[0], (options, single, ours)
    if ours[0] == "accepted" and dropout_p == 0:
        torch.testing.assert_close(ours[1], single[1], atol=1e-12, rtol=1e-10)


def _compile_worker(rank, world, port):
    init(rank, world, port)
    try:
        captured = []

        def recording_backend(graph_module, example_inputs):
            captured.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
            return graph_module.forward

        for exchange, causal, h_k in (("ring", True, 2), ("allgather", False, 4)):
            q, k, v, dout = (shard(t) for t in _full_inputs(4 * world, 4, h_k))

            def attend(q, k, v):
                return context_parallel_attn(q, k, v, causal=causal, softmax_scale=0.3, kv_exchange=exchange,
                                             backend="reference") * 2

            results = []
            for fn in (attend, torch.compile(attend, fullgraph=True, backend=recording_backend)):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = fn(*leaves)
                results.append((out, *torch.autograd.grad(out, leaves, dout)))
            for eager, compiled in zip(*results, strict=True):
                torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
            assert any("flash_attn_ck_cp.forward" in target for target in captured), captured
            torch._dynamo.reset()
    finally:
        teardown()


def _compile_group_worker(rank, world, port):
    from torch.distributed.device_mesh import init_device_mesh
    init(rank, world, port)
    try:
        q, k, v, dout = (shard(t.transpose(1, 2), seq_dim=2) for t in _full_inputs(4 * world, 4, 2))
        groups = {"the default ProcessGroup": dist.group.WORLD, "a new ProcessGroup": dist.new_group(range(world)),
                  "a 1-D DeviceMesh": init_device_mesh("cpu", (world,))}
        for what, group in groups.items():
            def attend(q, k, v, group=group):
                return context_parallel_sdpa(q, k, v, group, is_causal=True, enable_gqa=True, backend="reference")

            results = []
            for fn in (attend, torch.compile(attend, fullgraph=True, backend="aot_eager")):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = fn(*leaves)
                results.append((out, *torch.autograd.grad(out, leaves, dout)))
            for name, eager, compiled in zip(("out", "dq", "dk", "dv"), *results, strict=True):
                torch.testing.assert_close(compiled, eager, atol=0, rtol=0,
                                           msg=lambda m, n=name, w=what: f"{w} {n}: {m}")
            torch._dynamo.reset()
    finally:
        teardown()


def test_compile_fullgraph_takes_a_process_group():
    """torch.compile(fullgraph=True) of context_parallel_sdpa given a ProcessGroup (what the HF registration passes)
    or a 1-D DeviceMesh equals eager, gradients included: under compile a ProcessGroup is an opaque object whose
    unregistered attributes raise, so mesh and group are told apart by type, never by `hasattr`."""
    spawn(_compile_group_worker, 2)


def _comm_hook_worker(rank, world, port):
    from torch.nn.parallel import DistributedDataParallel
    init(rank, world, port)
    try:
        inputs = torch.randn(world, 3, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        local_grads = []
        for r in range(world):
            torch.manual_seed(0)
            linear = torch.nn.Linear(4, 2).double()
            linear(inputs[r]).square().sum().backward()
            local_grads.append(linear.weight.grad)
        alone = [dist.new_group([r]) for r in range(world)]      # every rank calls new_group for every group
        # (CP group, expected): DDP over the CP group sums; CP groups of one rank are data-parallel replicas: averaged
        for group, expected in ((dist.group.WORLD, sum(local_grads)), (alone[rank], sum(local_grads) / world)):
            torch.manual_seed(0)
            model = DistributedDataParallel(torch.nn.Linear(4, 2).double())
            cp.register_cp_comm_hook(model, group)
            model(inputs[rank]).square().sum().backward()
            torch.testing.assert_close(model.module.weight.grad, expected, atol=1e-12, rtol=1e-12)
        torch.manual_seed(0)
        linear = torch.nn.Linear(4, 2).double()
        linear(inputs[rank]).square().sum().backward()
        cp.sum_gradients(linear.parameters())
        torch.testing.assert_close(linear.weight.grad, sum(local_grads), atol=1e-12, rtol=1e-12)
    finally:
        teardown()


def test_cp_comm_hook_sums_over_cp_ranks_and_averages_over_replicas():
    """`register_cp_comm_hook`: DDP over the CP group sums the ranks' gradients (each rank's loss is a share of the
    global loss); over CP groups of one rank (data-parallel replicas) it averages as DDP does. `sum_gradients`
    sums without DDP."""
    spawn(_comm_hook_worker, 2)


def test_compile_fullgraph_captures_the_call():
    """torch.compile(fullgraph=True) traces context_parallel_attn as one custom op (process group by name), and
    the compiled forward and gradients equal eager ones."""
    spawn(_compile_worker, 2)


def test_flash_attn_fwd_draws_the_given_rng_state():
    """The ring's per-call keep patterns rest on `flash_attn_fwd(rng_state=)`: a given state draws one pattern
    (the same again, another without it), the backward given that state drops the same elements (out is linear
    in v, so <dout, out> = <dv, v>), and a bad state is refused."""
    from flash_attn_ck import flash_attn_bwd, flash_attn_fwd
    q, k, v, dout = _full_inputs(12, 2, 1, b=1)
    state = torch.tensor([123, 456])
    out, lse, returned = flash_attn_fwd(q, k, v, dropout_p=0.3, rng_state=state, backend="reference")
    assert torch.equal(returned, state)
    assert torch.equal(flash_attn_fwd(q, k, v, dropout_p=0.3, rng_state=state.clone(), backend="reference")[0], out)
    assert not torch.equal(flash_attn_fwd(q, k, v, dropout_p=0.3, backend="reference")[0], out)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dq, dk, dv, _ = flash_attn_bwd(dout, q, k, v, out, lse, dropout_p=0.3, rng_state=state, backend="reference")
    assert (dv * v).sum().item() == pytest.approx((dout * out).sum().item(), rel=1e-10)
    for bad in ([1, 2], torch.tensor([1, 2, 3]), torch.tensor([1.0, 2.0])):
        with pytest.raises(ArgumentError, match="rng_state"):
            flash_attn_fwd(*leaves, dropout_p=0.3, rng_state=bad, backend="reference")


@pytest.mark.parametrize("layout,causal,expected", [
    ("zigzag", True, ["slot 0", "call", "slot 1", "call"]),        # the first half's chunk waits for slot 0 only
    ("zigzag", False, ["slot 0", "slot 1", "call", "call"]),       # every chunk sees every key
    ("contiguous", True, ["slot 0", "call", "slot 1", "call"]),
])
def test_allgather_computes_while_the_second_slot_travels(one_process_group, monkeypatch, layout, causal, expected):
    """The all-gather exchange posts one collective per local chunk slot and a query chunk waits only for the
    slots holding its keys: a causal chunk of the first half runs before slot 1 is waited for, in the forward and
    the backward, and the result equals flash_attn_func's (a one-process group)."""
    events = []
    original_gather = transfers.PostedTransfers.gather

    def recording_gather(self, buffer, call):
        work, received = original_gather(self, buffer, call)
        slot = sum(e.startswith("posted") for e in events)
        events.append(f"posted {slot}")

        class Recorded:
            def wait(self):
                if f"slot {slot}" not in events:
                    events.append(f"slot {slot}")
                return work.wait()
        return Recorded(), received

    def recording(fn):
        def call(*args, **kwargs):
            events.append("call")
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(transfers.PostedTransfers, "gather", recording_gather)
    monkeypatch.setattr(allgather, "flash_attn_fwd", recording(allgather.flash_attn_fwd))
    monkeypatch.setattr(allgather, "flash_attn_bwd", recording(allgather.flash_attn_bwd))
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(_full_inputs(8, 2, 1, d=8, b=1)))
    out = context_parallel_attn(q, k, v, causal=causal, layout=layout, kv_exchange="allgather", backend="reference")
    forward_events = [e for e in events if not e.startswith("posted")]
    events.clear()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    backward_events = [e for e in events if not e.startswith("posted")]
    assert forward_events == expected and backward_events == expected, (forward_events, backward_events)
    reference = [t.detach().requires_grad_() for t in (q, k, v)]
    single = flash_attn_func(*reference, causal=causal, backend="reference")
    for ours, theirs in zip((out, *grads), (single, *torch.autograd.grad(single, reference, dout)), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("exchange", ["ring", "allgather", "a2a"])
def test_a_group_of_one_runs_forward_and_backward(one_process_group, exchange):
    """A ring of one rank: the exchange of K/V and of the travelling dK/dV sums is the identity (gloo refuses a send
    to oneself, which the ring backward posted); every exchange equals the one-process call."""
    q, k, v, dout = _full_inputs(8, 2, 1, d=8, b=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attn_func(*leaves, causal=True, backend="reference")
    expected = torch.autograd.grad(ref, leaves, dout)
    local = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attn(*local, causal=True, kv_exchange=exchange, backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    for grad, e in zip(torch.autograd.grad(out, local, dout), expected, strict=True):
        torch.testing.assert_close(grad, e, atol=1e-12, rtol=1e-10)


def test_the_gradients_are_not_differentiable(one_process_group):
    """create_graph=True (a gradient penalty): the gradients raise when differentiated, as one process's do, rather
    than carrying no graph (a silent zero second-order term)."""
    q, k, v, dout = _full_inputs(8, 2, 1, d=8, b=1)
    local = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attn(*local, causal=True, backend="reference")
    grads = torch.autograd.grad(out, local, dout, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        sum(g.square().sum() for g in grads).backward()


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 3).map(lambda n: 2 * n), min_size=1, max_size=4),
       start=st.integers(0, 4), swap=st.booleans(), extra=st.sampled_from([0, 0, 1, 2]))
def test_bad_varlen_offsets_are_named(one_process_group, lengths, start, swap, extra):
    """cu_seqlens must run from 0 without decreasing: an offset table that starts elsewhere or goes back is refused
    naming it (before: garbage, or torch's "inconsistent with step sign"), by the attention and by `shard`; so is
    one whose total is not the rows given (`extra` more); an inference tensor is read, not kept."""
    offsets = [start, *(start + n for n in itertools.accumulate(lengths))]
    if swap and len(offsets) > 2 and offsets[1] != offsets[2]:
        offsets[1], offsets[2] = offsets[2], offsets[1]
    bad = start != 0 or any(b < a for a, b in itertools.pairwise(offsets))
    rows = offsets[-1] + extra
    q, k, v = (torch.randn(rows, 2, 8, dtype=torch.float64) for _ in range(3))
    call = functools.partial(context_parallel_attn, q, k, v, causal=True, backend="reference")
    cu = torch.tensor(offsets, dtype=torch.int32)
    if bad or extra:
        refusal = r"^cu_seqlens: expected non-decreasing offsets from 0" if bad else r"^cu_seqlens: its total"
        with pytest.raises(ArgumentError, match=refusal):
            call(cu_seqlens=cu)
        with pytest.raises(ArgumentError, match=r"^cu_seqlens: expected non-decreasing offsets from 0"):
            shard(q, seq_dim=0, cu_seqlens=cu)
        return
    assert torch.equal(shard(q, seq_dim=0, cu_seqlens=cu), q)
    with torch.inference_mode():
        cu = torch.tensor(offsets, dtype=torch.int32)
        out = call(cu_seqlens=cu)
    expected = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, backend="reference")
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("return_lse", ["yes", 1, None, torch.tensor(True)])
def test_return_lse_takes_a_bool(one_process_group, return_lse):
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    with pytest.raises(ArgumentError, match=r"^return_lse: expected a bool"):
        context_parallel_attn(q, q, q, return_lse=return_lse, backend="reference")


@settings(max_examples=25, deadline=None)
@given(group=st.one_of(st.text(max_size=8), st.integers(), st.floats(), st.tuples(st.integers()), st.builds(object)))
def test_a_group_that_is_no_process_group_is_named(one_process_group, group):
    """Anything but a ProcessGroup, a DeviceMesh or None as the group (a group's name as torch's own context
    parallelism passes it, a rank, ...) is an ArgumentError naming `group`, on the attention and on the sharding."""
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    with pytest.raises(ArgumentError, match=r"^group: expected a torch.distributed ProcessGroup"):
        context_parallel_attn(q, q, q, group)
    with pytest.raises(ArgumentError, match=r"^group: expected a torch.distributed ProcessGroup"):
        shard(q, group)


@settings(max_examples=25, deadline=None)
@given(rank=st.integers(1, 4), seq_dim=st.one_of(st.integers(-40, -1), st.integers(0, 40)))
def test_a_seq_dim_outside_the_tensor_is_named(one_process_group, rank, seq_dim):
    """shard's seq_dim outside x's dimensions is an ArgumentError naming it; inside, a group of one's shard is x."""
    x = torch.randn(*(2,) * rank)
    if -rank <= seq_dim < rank:
        assert torch.equal(shard(x, seq_dim=seq_dim), x)
    else:
        with pytest.raises(ArgumentError, match=rf"^seq_dim: expected a dimension of x's {rank}, got {seq_dim}"):
            shard(x, seq_dim=seq_dim)
