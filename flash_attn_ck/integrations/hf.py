"""Context-parallel attention for Hugging Face `transformers` models, by name.

    from flash_attn_ck.integrations.hf import register_hf_attention
    register_hf_attention(mesh)                        # "context_parallel_ck" in transformers.AttentionInterface
    model = AutoModelForCausalLM.from_config(config, attn_implementation="context_parallel_ck")
    # every rank: its shard of input_ids, position_ids and the globally shifted labels (`shard_for_causal_lm`)
    loss = model(**shard_for_causal_lm(input_ids, mesh), use_cache=False).loss

The model's attention layers then call `context_parallel_attn` on (b, s / W, h, d) views of their projections:
causal over the whole sequence, GQA unexpanded, the layer's scaling and dropout, attention sinks (`s_aux`) as
`learnable_sink` (folded once into the merged lse), and sliding windows where the exchange runs them
(`kv_exchange="allgather"`; the ring refuses them, naming `sliding_window`). Everything else in the model works
per token, so it runs on the shard as it is, given the shard's global `position_ids` (RoPE). The causal LM loss
shifts labels inside the shard, which would pair tokens across chunk boundaries: `shard_for_causal_lm` shifts
them on the full sequence first (transformers' `shift_labels`) and passes `num_items_in_batch`, the group's
count of predicted tokens, so each rank's loss is its share of the global mean (sum them with an all-reduce;
the parameters' gradients likewise). One sequence per row: padding masks, packed documents (position_ids that
restart inside a row, `cu_seq_lens_*`) and what the attention cannot run (softcapping; a sliding window on the
ring) are refused with the argument named, never ignored.

One device, every flash-attn feature (`register_hf_attention_local`, "ck_attention"):

    from flash_attn_ck.integrations.hf import register_hf_attention_local
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_hf_attention_local())

The layers' (b, h, s, d) projections go to `flash_attn_func` as (b, s, h, d) views: causal bottom-right aligned
(decode steps against a KV cache included), GQA unexpanded, the layer's scaling, sliding window (HF's
`sliding_window` keys including the query's own: window (sliding_window - 1, 0)), softcap, and dropout while
the module trains. Rows with padding (the 2-D attention_mask), documents packed in a row (`cu_seq_lens_q/k`
with `max_length_q/k`, or `position_ids` restarting) run as `flash_attn_varlen_func`, as transformers' FA2
path does. Attention sinks (`s_aux`, GPT-OSS's per-head `sinks`) run as `learnable_sink`. What it cannot run
(`output_attentions`, paged caches, custom mask functions, a static cache without its mask) is refused with the
argument named.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch

from ..api import flash_attn_func, flash_attn_varlen_func
from ..core.checks import is_integer_tensor
from ..core.errors import ArgumentError
from .context_parallel import context_parallel_attn, process_group, shard

NAME = "context_parallel_ck"    # no "flash" in it: transformers would try to load a flash-attn kernel of that name
LOCAL_NAME = "ck_attention"
IGNORE_INDEX = -100


def register_hf_attention(mesh_or_group=None, *, name: str = NAME, layout: str = "zigzag", kv_exchange: str = "ring",
                          backend: str | None = None) -> str:
    """Register context-parallel attention over `mesh_or_group` (a 1-D DeviceMesh, a ProcessGroup or None: the
    default group) as `name` in transformers' AttentionInterface and AttentionMaskInterface; returns `name`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    group = process_group(mesh_or_group)

    positions: dict[tuple[int, torch.device], torch.Tensor] = {}   # (shard length, device) -> this shard's positions

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                  sliding_window=None, s_aux=None, **kwargs):
        if attention_mask is not None:
            raise ArgumentError(f"attention_mask: {name} takes unpadded sequences (the causal mask comes from "
                                "is_causal over the whole sequence); one sequence per row, without padding")
        for option, what in UNSUPPORTED_OPTIONS.items():
            if kwargs.get(option) is not None:
                raise ArgumentError(f"{option}: {name} does not run {what} (the layer asks for {option}="
                                    f"{_short(kwargs[option])}); use an attention implementation that does")
        for option in PACKING_OPTIONS:
            if kwargs.get(option) is not None:
                raise ArgumentError(f"{option}: {name} runs one sequence per row; packed documents would attend "
                                    "across each other")
        position_ids = kwargs.get("position_ids")
        if position_ids is not None:
            _check_positions(position_ids, positions, group, layout)
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if sliding_window is not None and kv_exchange != "allgather":
            raise ArgumentError(f"sliding_window: {name} runs sliding windows with kv_exchange='allgather' only "
                                f"(registered with {kv_exchange!r}; the layer asks for sliding_window="
                                f"{_short(sliding_window)})")
        # transformers' attention functions take (b, h, s, d) and return (b, s, h, d): the flash-attn layout
        return context_parallel_attn(*(t.transpose(1, 2) for t in (query, key, value)), group, softmax_scale=scaling,
                                     causal=causal, window_size=_window(sliding_window, causal), dropout_p=dropout,
                                     layout=layout, kv_exchange=kv_exchange, backend=backend,
                                     learnable_sink=s_aux), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, flash_attention_mask)   # None without padding, as for flash-attn
    return name


# Options transformers passes to attention functions that this one cannot honour: refused, never ignored.
UNSUPPORTED_OPTIONS = {"softcap": "logit softcapping"}
# What transformers passes for documents packed into one row (DataCollatorWithFlattening).
PACKING_OPTIONS = ("cu_seq_lens_q", "cu_seq_lens_k")


def _short(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


def _check_positions(position_ids: torch.Tensor, cache: dict, group, layout: str) -> None:
    """The causal mask runs over each row's whole sequence, so position_ids must be this rank's shard of 0..s-1
    (`shard_for_causal_lm`'s); positions restarting inside a row (packed documents) are refused. Compared on the
    device without a host sync (torch._assert_async: on a GPU a failure surfaces at the next synchronising call)."""
    if position_ids.dim() != 2:
        raise ArgumentError(f"position_ids: expected (b, s / W), got shape {tuple(position_ids.shape)}")
    key = (position_ids.shape[-1], position_ids.device)
    if key not in cache:
        world = torch.distributed.get_world_size(group)
        full = torch.arange(position_ids.shape[-1] * world, device=position_ids.device)[None]
        cache[key] = shard(full, group, layout=layout)
    torch._assert_async((position_ids == cache[key]).all(),
                        "position_ids: expected this rank's shard of 0..s-1 in every row (one sequence per row; "
                        "packed documents would attend across each other)")


def shard_for_causal_lm(input_ids: torch.Tensor, mesh_or_group=None, *, layout: str = "zigzag",
                        labels: torch.Tensor | None = None) -> dict:
    """This rank's keyword arguments for a causal LM's forward on the full (b, s) `input_ids` (the same on every
    rank): its shard of input_ids, of the global position_ids and of the labels shifted on the full sequence,
    and the group's number of predicted tokens. `labels`: default input_ids (next-token prediction)."""
    group = process_group(mesh_or_group)
    labels = input_ids if labels is None else labels
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    local = {name: shard(t, group, layout=layout) for name, t in
             (("input_ids", input_ids), ("position_ids", positions), ("shift_labels", shifted))}
    return dict(local, labels=local["shift_labels"], num_items_in_batch=(shifted != IGNORE_INDEX).sum())


# ---- one device -----------------------------------------------------------------------------------

def register_hf_attention_local(*, name: str = LOCAL_NAME, backend: str | None = None) -> str:
    """Register one-device attention through `flash_attn_func` / `flash_attn_varlen_func` as `name` in
    transformers' AttentionInterface and AttentionMaskInterface; returns `name`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                  softcap=None, is_causal=None, s_aux=None, **kwargs):
        _refuse_unsupported(name, kwargs)
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        options = dict(dropout_p=dropout if module.training else 0.0, softmax_scale=scaling, causal=causal,
                       window_size=_window(sliding_window, causal), softcap=softcap or 0.0,
                       deterministic=bool(kwargs.get("deterministic")), learnable_sink=s_aux, backend=backend)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))      # (b, s, h, d) views
        try:
            return local_attention(q, k, v, attention_mask, kwargs, options), None
        except ArgumentError as error:
            raise in_hf_terms(error) from None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _local_mask(name))
    return name


# Options transformers may pass that the one-device attention cannot honour, with what they ask for.
LOCAL_UNSUPPORTED = {"output_attentions": "return attention weights (flash kernels never form them)",
                     "block_table": "run paged KV caches (continuous batching)", "k_cache": "run paged KV caches",
                     "v_cache": "run paged KV caches"}


def _refuse_unsupported(name: str, kwargs: dict) -> None:
    for option, what in LOCAL_UNSUPPORTED.items():
        if kwargs.get(option) is not None and kwargs[option] is not False:
            raise ArgumentError(f"{option}: {name} does not {what}")


# flash_attn_ck's names of the options the attention passes on, as transformers' attention functions call them.
HF_NAMES = {"softmax_scale": "scaling", "dropout_p": "dropout", "learnable_sink": "s_aux"}


def in_hf_terms(error: ArgumentError) -> ArgumentError:
    """`error` (raised before anything ran) naming the argument as the attention's caller passed it."""
    message = str(error)
    name = message.split(":", 1)[0]
    return ArgumentError(f"{HF_NAMES[name]} ({name}){message[len(name):]}") if name in HF_NAMES else error


def _window(sliding_window: int | None, causal: bool) -> tuple[int, int]:
    """HF's `sliding_window` counts the query's own key: a query sees keys i - sliding_window < j <= i."""
    if sliding_window is None:
        return -1, -1
    if type(sliding_window) is not int or sliding_window < 1:
        raise ArgumentError(f"sliding_window: expected None or a positive int (the keys a query sees, its own "
                            f"included), got {sliding_window!r}")
    return sliding_window - 1, 0 if causal else sliding_window - 1


def local_attention(q, k, v, attention_mask, kwargs: dict, options: dict) -> torch.Tensor:
    """(b, s_q, h, d) attention of q on k, v (b, s_k, h_k, d): dense, or varlen for padding and packing."""
    if attention_mask is not None:
        return _unpadded(q, k, v, attention_mask, options)
    lengths = _given_lengths(kwargs)
    if lengths is None and q.shape[1] == k.shape[1] > 1:
        lengths = _lengths_from_positions(kwargs.get("position_ids"), q.shape[:2])
    if lengths is None:
        return flash_attn_func(q, k, v, **options)
    out = flash_attn_varlen_func(*(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), *lengths, **options)
    return out.view(*q.shape[:2], *out.shape[1:])      # v's head dim


def _given_lengths(kwargs: dict) -> tuple | None:
    """`cu_seq_lens_q/k` and `max_length_q/k` (HF's DataCollatorWithFlattening(return_flash_attn_kwargs=True)):
    used as given, without reading them on the host."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    cu_q, cu_k, max_q, max_k = (kwargs.get(option) for option in names)
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        missing = next(option for option, value in zip(names, (cu_q, cu_k, max_q, max_k)) if value is None)
        raise ArgumentError(f"{missing}: packed documents need cu_seq_lens_q, cu_seq_lens_k, max_length_q and "
                            "max_length_k together")
    for option, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if not is_integer_tensor(cu):
            raise ArgumentError(f"{option}: expected an integer tensor of offsets, got "
                                f"{getattr(cu, 'dtype', type(cu).__name__)}")
    return (cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k)


def _lengths_from_positions(position_ids: torch.Tensor | None, shape: tuple[int, int]) -> tuple | None:
    """The documents of rows whose positions restart (a position other than the previous one + 1 starts one),
    as varlen lengths over the flattened rows; None where no row restarts. Read on the host, as transformers'
    FA2 path does; under torch.compile they must not restart (checked on the device)."""
    if position_ids is None:
        return None
    if position_ids.dim() != 2 or position_ids.shape[1] != shape[1] or position_ids.shape[0] not in (1, shape[0]):
        raise ArgumentError(f"position_ids: expected (b, s) = {tuple(shape)} or (1, s), got shape "
                            f"{tuple(position_ids.shape)}")
    if torch.compiler.is_compiling():
        torch._assert_async(~_starts(position_ids, shape)[:, 1:].any(), "position_ids: restarting inside a row "
                            "(packed documents) under torch.compile; pass cu_seq_lens_q/k and max_length_q/k")
        return None
    return _documents(position_ids, shape)


def _once_per_forward(read):
    """`read(tensor, *args)` on the host once for the same tensor (unchanged) and args: transformers hands every
    layer the same position_ids and mask objects, so they are read once per forward, not once per layer."""
    last = {}

    @functools.wraps(read)
    def cached(tensor: torch.Tensor, *args):
        if torch.compiler.is_compiling():     # traced once per graph anyway; no state inside a graph
            return read(tensor, *args)
        key = (tensor._version, args)
        if last and last["tensor"]() is tensor and last["key"] == key:
            return last["value"]
        value = read(tensor, *args)
        last.update(tensor=weakref.ref(tensor), key=key, value=value)
        return value

    return cached


def _starts(position_ids: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    starts = torch.ones(shape, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


@_once_per_forward
def _documents(position_ids: torch.Tensor, shape: tuple[int, int]) -> tuple | None:
    starts = _starts(position_ids, shape)
    if not starts[:, 1:].any():
        return None
    cu = torch.nn.functional.pad(starts.flatten().nonzero().flatten(), (0, 1), value=starts.numel())
    cu = cu.to(torch.int32)
    longest = int(cu.diff().max())
    return cu, cu, longest, longest


def _unpadded(q, k, v, attention_mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Rows with padding (attention_mask (b, s_k), True for a real token; the queries are its last s_q columns)
    run as varlen on their real tokens; padded query rows come back zero."""
    if attention_mask.dim() != 2:
        raise ArgumentError(f"attention_mask: expected a 2-D (b, s_k) padding mask, got shape "
                            f"{tuple(attention_mask.shape)}; other masks cannot be run by flash kernels")
    batch, length = attention_mask.shape
    if batch != q.shape[0] or not q.shape[1] <= length <= k.shape[1]:
        raise ArgumentError(f"attention_mask: expected (b, s_k) with b = {q.shape[0]} and s_k from the "
                            f"{q.shape[1]} queries to the {k.shape[1]} keys, got shape {tuple(attention_mask.shape)}")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ArgumentError(f"attention_mask: expected a bool or 0/1 integer padding mask (True or 1 for a real "
                            f"token), got {attention_mask.dtype} (an additive float mask cannot be run here)")
    k, v = k[:, :attention_mask.shape[1]], v[:, :attention_mask.shape[1]]   # a static cache's unfilled slots
    keys = _tokens(attention_mask)
    queries = keys if q.shape[1] == k.shape[1] else _tokens(attention_mask[:, -q.shape[1]:])
    out = flash_attn_varlen_func(_rows(q, queries.indices), _rows(k, keys.indices), _rows(v, keys.indices),
                                 queries.cu_seqlens, keys.cu_seqlens, queries.longest, keys.longest, **options)
    padded = out.new_zeros(q.shape[0] * q.shape[1], *out.shape[1:]).index_copy(0, queries.indices, out)
    return padded.view(*q.shape[:2], *out.shape[1:])


class Tokens(NamedTuple):
    """The real tokens of padded rows, as a varlen call takes them."""
    indices: torch.Tensor       # flat indices into the (b * s) rows
    cu_seqlens: torch.Tensor
    longest: int


@_once_per_forward
def _tokens(mask: torch.Tensor) -> Tokens:
    """The real tokens of a (b, s) padding mask (read on the host)."""
    if mask.dtype != torch.bool and ((mask != 0) & (mask != 1)).any():
        raise ArgumentError("attention_mask: expected 0 (padding) or 1 (a real token) in every entry")
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return Tokens(mask.flatten().nonzero().flatten(), cu, int(lengths.max()))


def _rows(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[2:])[indices]


def _local_mask(name: str):
    """transformers' mask for flash-attn (None, or the 2-D padding mask), refusing what it would drop: custom
    mask functions and a static cache's unfilled keys without a mask to find them."""
    from transformers.masking_utils import flash_attention_mask

    def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, use_vmap=False,
             **kwargs):
        if use_vmap:
            raise ArgumentError(f"mask_function: {name} runs causal, sliding-window and padding masks only; this "
                                "model adds its own mask function (e.g. bidirectional image tokens)")
        if attention_mask is None and (isinstance(q_offset, torch.Tensor) or q_offset + q_length < kv_length):
            raise ArgumentError(f"attention_mask: {name} needs the 2-D mask with a static KV cache (keys past the "
                                "cache's filled length); use the default DynamicCache")
        return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                    attention_mask=attention_mask, **kwargs)

    return mask
