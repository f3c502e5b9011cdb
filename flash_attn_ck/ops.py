"""The flash_attn_ck operators (namespace `flash_attn_ck`) and the autograd function around them.

Ops are declared with `torch.library.define` + `impl` + `register_fake` rather than
`@torch.library.custom_op`, and autograd is a `torch.autograd.Function` outside them: the custom_op
wrapper and its registered autograd cost as much host time per backward as the kernels of a small call
take on the GPU (`scripts/launch_overhead.py --breakdown` measures it; PyTorch issues #139500, #176592).
`torch.compile(fullgraph=True)` traces the Function and sees the ops
through their fakes, so compiled graphs keep one opaque op per direction; in plain eager mode the
Function calls the ops' implementations itself (`_direct`) and its backward reuses the forward's
validated problem. Ops cannot return None:
absent optional results are empty tensors (`rng_state` without dropout, `probs` unless requested).

- `fwd(q, k, v, ..., *, rng_state=None) -> (out, softmax_lse, rng_state, probs)` (a given rng_state: its keep
  pattern; none: a fresh draw); not differentiable by itself:
  `attention(...)` (the Function) makes `out` differentiable.
- `fwd_out(q, k, v, out, ...) -> (softmax_lse, rng_state, probs)`: the same, writing into a caller-provided
  `out` (declared as mutated); not differentiable (`attention_into`).
- `bwd(dout, q, k, v, out, softmax_lse, ...) -> (dq, dk, dv, softmax_d)`
- `bwd_out(...)`: the same, writing into caller-provided dq/dk/dv (declared as mutated).

With dropout, `fwd` draws `rng_state` on the device from torch's default generator (core/dropout.py),
so it is random per call like `torch.nn.functional.dropout`: reseeding reproduces it, and a captured CUDA
graph draws a fresh one on every replay. The fakes allocate exactly as the real ops do (the shared
rules), so shapes, dtypes and strides match for every backend.

The call's options travel as one `AttentionOptions`; schemas take plain types, so `_flatten` /
`_unflatten` below are the one place where the object becomes schema arguments and back, and the
schemas are generated from the same table.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
from torch._C import _len_torch_dispatch_stack

from .backends.base import Backend
from .backends.registry import backend_from_key, backend_key
from .core import checks
from .core.inputs import check_shapes, varlen_arguments
from .core.options import AttentionOptions
from .core.problem import pad_head_dim, result_shape, row_stats_shape
from .core.sink import sink_gradient
from .pipeline.backward import attention_backward, check_backward_operands
from .pipeline.forward import attention_forward, check_forward_out
from .pipeline.prepare import PreparedCall, prepare

# ---- the options as schema arguments: one table, one flatten, one unflatten ----------------------

# Every AttentionOptions field -> its schema arguments (schemas have no tuples: the window is two ints).
_SCHEMA = {
    "cu_seqlens_q": "Tensor? cu_seqlens_q", "cu_seqlens_k": "Tensor? cu_seqlens_k", "seqused_k": "Tensor? seqused_k",
    "max_seqlen_q": "SymInt? max_seqlen_q", "max_seqlen_k": "SymInt? max_seqlen_k",
    "alibi_slopes": "Tensor? alibi_slopes", "dropout_p": "float dropout_p", "softmax_scale": "float? softmax_scale",
    "causal": "bool causal", "window_size": "int window_left, int window_right", "softcap": "float softcap",
    "deterministic": "bool deterministic", "return_attn_probs": "bool return_probs", "backend": "str backend",
    "max_workspace_bytes": "int? max_workspace_bytes=None", "out_dtype": "ScalarType? out_dtype=None",
    "learnable_sink": "Tensor? learnable_sink=None",
}
assert set(_SCHEMA) == {f.name for f in fields(AttentionOptions)}, "every option needs its schema arguments"
# Which options each op takes, in schema order (rng_state, an operand, sits between them in the backward).
_COMMON = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k", "alibi_slopes", "dropout_p",
           "softmax_scale", "causal", "window_size", "softcap", "deterministic")
_FWD = (*_COMMON, "return_attn_probs", "backend", "out_dtype", "learnable_sink")
# The backward ops take no sink: given the folded out and lse, the kernels' gradients are the sink's, and dsink is
# computed from softmax_d around them (core/sink.py).
_BWD_TAIL = ("backend", "max_workspace_bytes", "out_dtype")
_DEFAULT_OPTIONS = AttentionOptions()
# Schema arguments with a default (at the end of a schema): a call of the op may leave them out.
_DEFAULTED = frozenset(name for name, schema in _SCHEMA.items() if schema.endswith("=None"))


def _schema(names: tuple[str, ...]) -> str:
    return ", ".join(_SCHEMA[name] for name in names)


def _flatten(options: AttentionOptions, names: tuple[str, ...]) -> tuple:
    """The options `names` as schema arguments (see _SCHEMA)."""
    args = []
    for name in names:
        value = getattr(options, name)
        if name == "window_size":
            args += value
        elif name == "backend":
            args.append(backend_key(value))
        else:
            args.append(value)
    return tuple(args)


def _unflatten(args: tuple, names: tuple[str, ...], checked: bool = False) -> AttentionOptions:
    """The inverse of `_flatten` (options not in `names`, or left out where the schema has a default, keep their
    defaults). `checked`: the arguments are `_flatten`'s of a validated AttentionOptions, not an op's (which anyone
    may call with raw values)."""
    values: dict[str, Any] = {}
    remaining = list(args)
    for name in names:
        if name == "window_size":
            values[name] = (remaining.pop(0), remaining.pop(0))
        elif name == "backend":
            values[name] = backend_from_key(remaining.pop(0))
        elif remaining or name not in _DEFAULTED:
            values[name] = remaining.pop(0)
    return _DEFAULT_OPTIONS.replace_checked(**values) if checked else AttentionOptions(**values)


torch.library.define("flash_attn_ck::fwd", f"(Tensor q, Tensor k, Tensor v, {_schema(_FWD)}, *, "
                     "Tensor? rng_state=None) -> (Tensor, Tensor, Tensor, Tensor)")
torch.library.define("flash_attn_ck::fwd_out", f"(Tensor q, Tensor k, Tensor v, Tensor(a!) out, {_schema(_FWD)}, *, "
                     "Tensor? rng_state=None) -> (Tensor, Tensor, Tensor)")
torch.library.define("flash_attn_ck::bwd", f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                     f"Tensor softmax_lse, {_schema(_COMMON)}, Tensor? rng_state, {_schema(_BWD_TAIL)}) "
                     "-> (Tensor, Tensor, Tensor, Tensor)")
torch.library.define("flash_attn_ck::bwd_out", f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                     "Tensor softmax_lse, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, "
                     f"{_schema(_COMMON)}, Tensor? rng_state, {_schema(_BWD_TAIL)}) -> Tensor")
# The ops themselves are not differentiable (the Function below is): autograd falls through to the
# kernels, so their outputs never carry a grad_fn and no autograd bookkeeping runs per call.
for _name in ("fwd", "fwd_out", "bwd", "bwd_out"):
    torch.library.impl(f"flash_attn_ck::{_name}", "Autograd", torch.library.fallthrough_kernel)


def _bwd_options(args: tuple) -> tuple[AttentionOptions, torch.Tensor | None]:
    """A backward op's options (the common ones, then rng_state, then _BWD_TAIL) and its rng_state."""
    common, rng_state, tail = args[:len(_COMMON) + 1], args[len(_COMMON) + 1], args[len(_COMMON) + 2:]
    options = _unflatten(common + tail, _COMMON + _BWD_TAIL)
    return options, _drawn(rng_state)


# ---- forward -------------------------------------------------------------------------------------

def _op_results(out, lse, rng_state, probs) -> tuple[torch.Tensor, ...]:
    """A forward op's four tensors: an absent rng_state or probs as an empty placeholder (probs keeping the dtype a
    present one has, fp32/fp64 like lse, so the fake matches). Only the ops allocate them: a direct call passes None."""
    rng_state = torch.empty(0, dtype=torch.int64, device=lse.device) if rng_state is None else rng_state
    return out, lse, rng_state, lse.new_empty(0) if probs is None else probs


def _fwd(q, k, v, *options, rng_state=None):
    return _op_results(*attention_forward(q, k, v, _unflatten(options, _FWD), rng_state)[:4])


# The kernels run under no_grad: the Autograd fallthrough does not exclude autograd from the ops they call.
torch.library.impl("flash_attn_ck::fwd", "CompositeExplicitAutograd", torch.no_grad()(_fwd))


def _fwd_out(q, k, v, out, *options, rng_state=None):
    return _op_results(*attention_forward(q, k, v, _unflatten(options, _FWD), rng_state, out)[:4])[1:]


torch.library.impl("flash_attn_ck::fwd_out", "CompositeExplicitAutograd", torch.no_grad()(_fwd_out))


@torch.library.register_fake("flash_attn_ck::fwd")
def _(q, k, v, *flat, rng_state=None):
    results = _fake_results(q, k, v, flat)      # the checks first: v's head dim is read below
    head_dim_v = v.shape[-1]      # out: q's rows and heads, v's head dim
    # out is a view of a buffer padded to a multiple of 8, exactly as the real op returns it.
    out = q.new_empty((*q.shape[:-1], pad_head_dim(head_dim_v)),
                      dtype=_unflatten(flat, _FWD).out_dtype)[..., :head_dim_v]
    return out, *results


@torch.library.register_fake("flash_attn_ck::fwd_out")
def _(q, k, v, out, *flat, rng_state=None):
    results = _fake_results(q, k, v, flat)
    options = _unflatten(flat, _FWD)
    check_forward_out(q, k, v, out, options, rng_state, checks.check_out_dtype_for(options.out_dtype, q.dtype),
                      result_shape(q, v))
    return results


def _fake_results(q, k, v, flat: tuple) -> tuple[torch.Tensor, ...]:
    """The fakes' lse, rng_state and probs, as the real forward allocates them, after the real forward's checks
    that read no tensor's values (check_shapes), so that a traced call fails as an eager one does. The values
    (cu_seqlens offsets, seqused_k against them) are not there to read: the real op checks them where it runs."""
    options = _unflatten(flat, _FWD)
    check_shapes(q, k, v, options)
    accum = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = q.new_empty(row_stats_shape(tuple(q.shape[:-2]), q.shape[-2]), dtype=accum)
    if options.varlen:      # the problem's lengths: max_seqlen, bounded by the packed rows (core/inputs.py)
        given = varlen_arguments(options)
        batch = given.cu_seqlens_q.shape[0] - 1
        seqlen_q = torch.sym_min(given.max_seqlen_q, q.shape[0])
        seqlen_k = torch.sym_min(given.max_seqlen_k, k.shape[0])
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    rng_state = q.new_empty((2 if options.dropout_p > 0 else 0,), dtype=torch.int64)
    probs = lse.new_empty((batch, q.shape[-2], seqlen_q, seqlen_k) if options.return_attn_probs else (0,))
    return lse, rng_state, probs


# ---- backward ------------------------------------------------------------------------------------

def _bwd(dout, q, k, v, out, softmax_lse, *flat):
    options, rng_state = _bwd_options(flat)
    return attention_backward(dout, q, k, v, out, softmax_lse, None, None, None, options, rng_state)


torch.library.impl("flash_attn_ck::bwd", "CompositeExplicitAutograd", torch.no_grad()(_bwd))


@torch.library.register_fake("flash_attn_ck::bwd")
def _(dout, q, k, v, out, softmax_lse, *args, **kwargs):
    options, rng_state = _bwd_options(args)
    _check_fake_backward(dout, q, k, v, out, softmax_lse, None, None, None, options, rng_state)
    dtype = options.out_dtype
    return (*(torch.empty_like(t, dtype=dtype) for t in (q, k, v)), softmax_lse.new_empty(softmax_lse.shape))


def _bwd_out(dout, q, k, v, out, softmax_lse, dq, dk, dv, *flat):
    options, rng_state = _bwd_options(flat)
    return attention_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, options, rng_state)[3]


torch.library.impl("flash_attn_ck::bwd_out", "CompositeExplicitAutograd", torch.no_grad()(_bwd_out))


@torch.library.register_fake("flash_attn_ck::bwd_out")
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, *args):
    _check_fake_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, *_bwd_options(args))
    return softmax_lse.new_empty(softmax_lse.shape)


def _check_fake_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, options, rng_state) -> None:
    """The real backward's checks that read no tensor's values (as `_fake_results` for the forward)."""
    check_shapes(q, k, v, options)
    check_backward_operands(q, k, v, dout, out, softmax_lse, dq, dk, dv, rng_state, options)


# ---- autograd: a Function around the forward op ----------------------------------------------------

_fwd_op = torch.ops.flash_attn_ck.fwd.default
_fwd_out_op = torch.ops.flash_attn_ck.fwd_out.default
_bwd_op = torch.ops.flash_attn_ck.bwd.default
_bwd_out_op = torch.ops.flash_attn_ck.bwd_out.default


def _direct(q) -> bool:
    """Whether the Function may call the ops' implementations directly instead of through the
    dispatcher: in plain eager mode (no compile tracing, no dispatch mode such as FakeTensorMode or
    FlopCounterMode, no tensor subclass), where the dispatcher would only box and unbox the 20-odd
    arguments and call the same Python function (host time a small call feels, `launch_overhead.py
    --breakdown`), and the backward can reuse the forward's validated problem.
    Everywhere else the ops run, so graphs, fakes and modes see one opaque op per direction."""
    # is_compiling() first: dynamo folds it to True and never traces the mode query (the dispatch mode stack's
    # depth: what torch.utils._python_dispatch._get_current_dispatch_mode reads, without its Python wrapper).
    return not torch.compiler.is_compiling() and type(q) is torch.Tensor and not _len_torch_dispatch_stack()


class _Attention(torch.autograd.Function):
    """`fwd` with `out` differentiable; its backward is the `bwd` op (or, eagerly, its implementation).

    It takes the flattened options (`_flatten(options, _FWD)`), as dynamo traces a Function's
    arguments, or eagerly (`_direct`) the validated `AttentionOptions` itself and the call's memoised
    preparation (or None), which saves flattening and unflattening them; ctx keeps them as one
    `AttentionOptions`."""

    @staticmethod
    def forward(ctx, q, k, v, sink, given_rng_state, *flat):
        # `attention` passes the learnable sink (an input of its own, so that it gets a gradient) and validated
        # options after the rng_state to draw (None: fresh): eagerly (it checked `_direct`) the options whole and
        # the call's PreparedCall or None, else flattened without the sink
        if type(flat[0]) is AttentionOptions:      # Function.forward runs under no_grad already
            options = flat[0]
            out, lse, rng_state, probs, ctx.prepared = attention_forward(q, k, v, options, given_rng_state, None,
                                                                         flat[1])
        else:
            options = _unflatten(flat, _FWD, checked=True)
            if sink is not None:
                options = options.replace_checked(learnable_sink=sink)
            out, lse, rng_state, probs = _fwd_op(q, k, v, *_flatten(options, _FWD), rng_state=given_rng_state)
            ctx.prepared = None
        # Only `out` carries a gradient: the backward has no term for lse or probs, so they are marked
        # non-differentiable instead of having their gradients silently dropped.
        if rng_state is None and probs is None:     # the common eager call: no dropout, no probabilities
            ctx.mark_non_differentiable(lse)
        else:
            ctx.mark_non_differentiable(*(t for t in (lse, rng_state, probs) if t is not None))
        # Nothing flows back into lse/rng_state/probs: without this, autograd would allocate and zero
        # an lse-sized gradient (one more fill kernel) on every backward.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, options.cu_seqlens_q, options.cu_seqlens_k, options.seqused_k,
                              options.alibi_slopes, rng_state, sink)
        ctx.options = options
        ctx.num_inputs = 5 + len(flat)
        return out, lse, rng_state, probs

    @staticmethod
    def backward(ctx, dout, *_non_differentiable):
        if dout is None:   # an undefined gradient of `out` (not materialised): zero gradients, as None
            return (None,) * ctx.num_inputs
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, rng_state, sink = ctx.saved_tensors
        if dout.stride(-1) != 1:
            # A sparse gradient of out (out.backward(sparse), eager only: compiled backwards may not read layout)
            # has no strides for the kernels: its dense values.
            sparse = not torch.compiler.is_compiling() and dout.layout != torch.strided
            dout = dout.to_dense() if sparse else dout.contiguous()
        # The saved tensors (unpacking them checked that they were not modified in place), which are ctx.options'
        # own unless saved tensor hooks (e.g. offloading) unpacked other objects.
        options = ctx.options
        if not (cu_seqlens_q is options.cu_seqlens_q and cu_seqlens_k is options.cu_seqlens_k
                and seqused_k is options.seqused_k and alibi_slopes is options.alibi_slopes):
            options = options.replace_checked(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                              seqused_k=seqused_k, alibi_slopes=alibi_slopes)
        create_graph = torch.is_grad_enabled()
        if ctx.prepared is not None and not create_graph and _direct(q):      # create_graph: the op
            dq, dk, dv, softmax_d = attention_backward(dout, q, k, v, out, lse, None, None, None, options,
                                                       _drawn(rng_state), prepared=ctx.prepared)
        else:
            dq, dk, dv, softmax_d = _bwd_op(dout, q, k, v, out, lse, *_flatten(options, _COMMON), rng_state,
                                            *_flatten(options, _BWD_TAIL[:1]))
        dsink = sink_gradient(sink, lse, softmax_d) if sink is not None and ctx.needs_input_grad[3] else None
        if create_graph and not torch.compiler.is_compiling():
            # create_graph=True: the gradients are not differentiable (flash-attn's backward is not either).
            # Rather than returning dq/dk/dv without a graph (a silent zero second-order term), they carry a
            # node that raises when anything differentiates through them.
            if dsink is None:
                dq, dk, dv = not_twice_differentiable((dq, dk, dv), (q, k, v, dout))
            else:
                dq, dk, dv, dsink = not_twice_differentiable((dq, dk, dv, dsink), (q, k, v, sink, dout))
        return (dq, dk, dv, dsink) + (None,) * (ctx.num_inputs - 4)


DOUBLE_BACKWARD_MESSAGE = (
    "flash_attn_ck: the attention backward is not differentiable (double backward, e.g. a gradient penalty "
    "through create_graph=True, is not supported; flash-attn's is not either)")


def not_twice_differentiable(grads, sources):
    """`grads` behind torch's DelayedError node (what `once_differentiable` uses): backpropagating through
    them raises DOUBLE_BACKWARD_MESSAGE; using their values is fine. The node also takes `sources` (what the
    gradients depend on: q, k, v, dout), so it lies on every path from a gradient to them: an
    `autograd.grad(..., inputs)` reaches it and raises too, rather than finding no path and answering None
    (`allow_unused`) or zero (gradgradcheck), as it would with the gradients' detached copies alone."""
    error = torch._C._functions.DelayedError(DOUBLE_BACKWARD_MESSAGE, len(grads) + len(sources))
    detached = []
    for g in grads:
        g = g.detach()
        g.requires_grad_(True)
        detached.append(g)
    return error(*detached, *sources)[:len(grads)]


def backward(dout, q, k, v, out, softmax_lse, options: AttentionOptions, rng_state):
    """The `bwd` op -> `(dq, dk, dv, softmax_d)`; eagerly (`_direct_backward`) its implementation itself."""
    if _direct_backward(dout, q, k, v, out, softmax_lse):
        _check_backend(options)
        with torch.no_grad():       # as the op's implementation runs
            return attention_backward(dout, q, k, v, out, softmax_lse, None, None, None, options,
                                      _drawn(rng_state))
    return _bwd_op(dout, q, k, v, out, softmax_lse, *_flatten(options, _COMMON), rng_state,
                   *_flatten(options, _BWD_TAIL))


def backward_into(dout, q, k, v, out, softmax_lse, dq, dk, dv, options: AttentionOptions, rng_state):
    """The `bwd_out` op: writes dq/dk/dv, returns softmax_d; eagerly (`_direct_backward`) its implementation itself."""
    if _direct_backward(dout, q, k, v, out, softmax_lse):
        _check_backend(options)
        with torch.no_grad():
            return attention_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, options, _drawn(rng_state))[3]
    return _bwd_out_op(dout, q, k, v, out, softmax_lse, dq, dk, dv, *_flatten(options, _COMMON), rng_state,
                       *_flatten(options, _BWD_TAIL))


def _direct_backward(dout, q, k, v, out, softmax_lse) -> bool:
    """Whether `backward`/`backward_into` may run the ops' implementation directly, as `_direct` says for the
    forward, with every operand a plain tensor: the dispatcher would box ~25 arguments, and the implementation
    rebuild and re-check the options the API has just built (about half a small call's host time: bench/cpu.md)."""
    return _direct(q) and type(dout) is type(k) is type(v) is type(out) is type(softmax_lse) is torch.Tensor


def _drawn(rng_state: torch.Tensor | None) -> torch.Tensor | None:
    """A backward op's rng_state as the pipeline takes it: an empty one (the forward drew none) as None."""
    return rng_state if rng_state is not None and rng_state.numel() else None


def prepared(q, k, v, options: AttentionOptions) -> PreparedCall | None:
    """Eagerly (`_direct`: where `attention` runs the pipeline itself), the call's preparation (pipeline/prepare.py:
    memoised per signature; a hit runs only its value checks), else None: the op prepares it where it runs, and a
    q on the meta device is the caller's to refuse first. It has passed every check that the metadata of q, k, v
    and the options' tensors decides (types, dtypes, shapes, strides, devices, each tensor on q's device); pass it
    to `attention` / `attention_into`."""
    return prepare(q, k, v, options) if _direct(q) and not q.is_meta else None


def attention(q, k, v, options: AttentionOptions, rng_state=None, call: PreparedCall | None = None):
    """The forward -> `(out, softmax_lse, rng_state, probs)`, differentiable in `out` (rng_state and probs: None or
    an empty tensor where the call has none); `rng_state`: the dropout keep pattern to draw (None: a fresh one);
    `call`: `prepared(q, k, v, options)`."""
    if call is not None or _direct(q):
        _check_backend(options)
        if not torch.is_grad_enabled():    # nothing to differentiate: the Function would add only its cost
            return attention_forward(q, k, v, options, rng_state, None, call)[:4]
        return _Attention.apply(q, k, v, options.learnable_sink, rng_state, options, call)
    # Dynamo cannot trace a Function given one tensor twice (self-attention on one tensor, shared
    # cu_seqlens): repeats become views, which change nothing else (gradients flow through them).
    q, k, v, cu_seqlens_q, cu_seqlens_k = _distinct(q, k, v, options.cu_seqlens_q, options.cu_seqlens_k)
    if cu_seqlens_q is not options.cu_seqlens_q or cu_seqlens_k is not options.cu_seqlens_k:
        options = options.replace_checked(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    sink = options.learnable_sink
    if sink is not None:
        options = options.replace_checked(learnable_sink=None)
    return _Attention.apply(q, k, v, sink, rng_state, *_flatten(options, _FWD))


def attention_into(q, k, v, out, options: AttentionOptions, rng_state=None, call: PreparedCall | None = None):
    """The forward written into the caller's `out` -> `(softmax_lse, rng_state, probs)`. Not differentiable:
    the caller makes sure nothing needs a gradient. `call`: `prepared(q, k, v, options)`."""
    if call is not None or _direct(q):
        _check_backend(options)
        with torch.no_grad():       # as the op's implementation: `out` never records a graph
            return attention_forward(q, k, v, options, rng_state, out, call)[1:4]
    return _fwd_out_op(q, k, v, out, *_flatten(options, _FWD), rng_state=rng_state)


def _check_backend(options: AttentionOptions) -> None:
    """The direct paths' stand-in for the flattening's check of `backend` (it names `backend`)."""
    if not (options.backend is None or isinstance(options.backend, (str, Backend))):
        backend_key(options.backend)


def _distinct(*tensors):
    # `is`, not id(): dynamo resolves `is` between inputs while tracing, but guards id() on the object.
    result = []
    for t in tensors:
        if t is not None and any(t is earlier for earlier in result):
            t = t.view_as(t)
        result.append(t)
    return result
