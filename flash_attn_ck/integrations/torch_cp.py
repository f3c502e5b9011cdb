"""flash_attn_ck's ring inside torch's own context parallelism (`torch.distributed.tensor.experimental`).

torch's CP hands SDPA's aten ops on sequence-sharded DTensors to its ring template, which calls the op once
per step. With the SDPA provider (`sdpa.py`) active that op runs our kernels, but two things go wrong
silently (torch 2.11-2.13):
- dropout: the template gives every backward step the *last* forward step's rng state, so the gradients do
  not belong to the forward's keep patterns;
- the efficient and cuDNN SDPA ops are routed to the same ring; the provider does not override them, so
  when SDPA picks one of them our kernels simply do not run.

`install_torch_cp_handlers()` (opt-in) replaces the entries of torch's CP dispatcher for the flash op and its
backward with our ring (`context_parallel.forward` / `backward`): each kernel call of the ring draws its own
keep pattern, derived from one `[seed, offset]` that the forward returns in the op's philox outputs, and the
backward derives the same ones. With `strict=True` (the default) the efficient and cuDNN entries raise an
error naming the fix instead of running torch's kernels. `remove()` on the returned handle restores torch's
entries. Without the install, the provider refuses dropout while torch's own CP ring is on (`sdpa.py`).

Layout: with load balancing on (torch's default for causal CP, `_HeadTailLoadBalancer`) torch's shards are our
"zigzag" shards; without it, "contiguous". The handlers read torch's `_cp_options` to know which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.errors import ArgumentError
from ..core.options import AttentionOptions
from . import context_parallel as cp
from .sdpa import UnsupportedCall, out_like_query, positive_scale, rng_input, rng_outputs

_aten = torch.ops.aten
FLASH_OPS = (_aten._scaled_dot_product_flash_attention.default,
             _aten._scaled_dot_product_flash_attention_backward.default)
OTHER_SDPA_OPS = (_aten._scaled_dot_product_efficient_attention.default,
                  _aten._scaled_dot_product_efficient_attention_backward.default,
                  _aten._scaled_dot_product_cudnn_attention.default,
                  _aten._scaled_dot_product_cudnn_attention_backward.default)


def _torch_cp():
    from torch.distributed.tensor.experimental._context_parallel import _attention
    return _attention


@dataclass(frozen=True)
class _RingHandlers:
    """The local (per-rank) implementations of the flash op and its backward on torch's sharded inputs."""

    kv_exchange: str = "ring"
    backend: str | None = None

    def _plan(self, mesh, query, key, value, dropout_p, is_causal, scale):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        q, scale, sign = positive_scale(q, scale)
        options = AttentionOptions(softmax_scale=scale, causal=is_causal, dropout_p=dropout_p, backend=self.backend)
        layout = "zigzag" if _torch_cp()._cp_options.enable_load_balance else "contiguous"
        k, v = k.contiguous(), v.contiguous()
        call = cp.plan_call(q, k, v, mesh.get_group(), options=options, layout=layout, kv_exchange=self.kv_exchange)
        return q, k, v, call, sign

    def forward(self, mesh, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                scale=None):
        if return_debug_mask:
            raise UnsupportedCall("flash_attn_ck's context-parallel ring: return_debug_mask=True is not supported")
        q, k, v, call, _ = self._plan(mesh, query, key, value, dropout_p, is_causal, scale)
        out = out_like_query(query, value)
        _, lse, call = cp.forward(q, k, v, call, out=out.transpose(1, 2))
        seed, offset = rng_outputs(call.rng_base, query.device)
        return out, lse, None, None, query.size(2), key.size(2), seed, offset, query.new_empty(0)

    def backward(self, mesh, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                 dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        q, k, v, call, sign = self._plan(mesh, query, key, value, dropout_p, is_causal, scale)
        call = call.with_rng(rng_input(dropout_p, philox_seed, philox_offset))
        grads = cp.backward(grad_out.transpose(1, 2), q, k, v, out.transpose(1, 2), logsumexp.contiguous(), call)
        results = tuple(torch.empty_like(t) for t in (query, key, value))
        for result, grad in zip(results, grads, strict=True):
            result.transpose(1, 2).copy_(grad)
        if sign != 1.0:
            results[0].mul_(sign)
        return results


def _on_dtensors(local_fn):
    """A CP dispatcher entry: DTensor arguments -> `local_fn(mesh, *local args)` -> DTensor results, as torch's
    own `_sdpa_handler` does (sharding propagation gives the output placements)."""
    def handler(op_call, args, kwargs):
        from torch.distributed.tensor import DTensor
        dispatcher = DTensor._op_dispatcher
        op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        dispatcher.sharding_propagator.propagate(op_info)
        sharding = op_info.output_sharding
        if sharding is None or sharding.needs_redistribute:
            raise UnsupportedCall(f"flash_attn_ck's context-parallel ring: {op_call} needs its inputs sharded on "
                                  "the sequence (Shard(2)) as torch's CP shards them")
        return dispatcher.wrap(local_fn(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs),
                               sharding.output_spec)
    return handler


def _refuse_other_backend(op_call, args, kwargs):
    raise UnsupportedCall(
        f"torch's context parallelism reached {op_call}: SDPA chose a backend other than flash, where "
        "flash_attn_ck's ring does not run. Call SDPA under torch.nn.attention.sdpa_kernel(SDPBackend."
        "FLASH_ATTENTION) so that a call flash cannot take fails instead of falling back (or install with "
        "strict=False to let torch's ring run it on torch's kernels)")


# The exchanges torch's one-dimensional CP mesh can run.
TORCH_CP_EXCHANGES = tuple(exchange for exchange in cp.KV_EXCHANGES if exchange != "a2a+ring")


@dataclass(eq=False)        # compared by identity: two handles with equal entries are two installations
class TorchCPHandle:
    """What `install_torch_cp_handlers` returns: `remove()` puts torch's own entries back."""

    saved: dict = field(default_factory=dict)

    def remove(self) -> None:
        """Undo this installation, in any order of several: an entry a later installation replaced goes to that
        one's saved entries (it puts it back when removed); any other entry is put back now."""
        if self not in _INSTALLED:
            return
        later = _INSTALLED[_INSTALLED.index(self) + 1:]
        now = {}
        for op, entry in self.saved.items():
            successor = next((handle for handle in later if op in handle.saved), None)
            if successor is None:
                now[op] = entry
            else:
                successor.saved[op] = entry
        _set_entries(now)
        _INSTALLED.remove(self)
        self.saved = {}

    def __enter__(self) -> TorchCPHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


# Installed handles, oldest first.
_INSTALLED: list[TorchCPHandle] = []


def _set_entries(entries: dict) -> None:
    """Set entries of torch's CP op table, and of the live dispatcher table where CP is on now."""
    from torch.distributed.tensor import DTensor
    torch_cp = _torch_cp()
    live = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in entries.items():
        if live.get(op) is torch_cp.custom_ops.get(op):
            live[op] = handler
        torch_cp.custom_ops[op] = handler


def install_torch_cp_handlers(*, strict: bool = True, kv_exchange: str = "ring", backend: str | None = None
                              ) -> TorchCPHandle:
    """Run torch's context parallelism for SDPA's flash op on flash_attn_ck's ring (see the module docstring).

    Args:
        strict: make torch's CP raise for SDPA's efficient and cuDNN ops (a fallback away from flash) instead of
            running them on torch's kernels.
        kv_exchange: "ring", "allgather" or "a2a" (as `context_parallel_attn`; torch's `set_rotate_method` is
            ignored).
        backend: flash_attn_ck backend for the kernels (None: automatic).

    Returns:
        a handle whose `remove()` (or a `with` block's end) restores torch's own entries.
    """
    if kv_exchange not in TORCH_CP_EXCHANGES:
        raise ArgumentError(f"kv_exchange: expected one of {TORCH_CP_EXCHANGES} (torch's CP mesh is 1-D; "
                               f"a2a+ring needs a 2-D one), got {kv_exchange!r}")
    ring = _RingHandlers(kv_exchange, backend)
    entries = dict(zip(FLASH_OPS, (_on_dtensors(ring.forward), _on_dtensors(ring.backward)), strict=True))
    if strict:
        entries |= dict.fromkeys(OTHER_SDPA_OPS, _refuse_other_backend)
    torch_cp = _torch_cp()
    handle = TorchCPHandle({op: torch_cp.custom_ops[op] for op in entries})
    _set_entries(entries)
    _INSTALLED.append(handle)
    return handle
