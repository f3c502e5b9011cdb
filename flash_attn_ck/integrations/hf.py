"""Context-parallel attention for Hugging Face `transformers` models, by name.

    from flash_attn_ck.integrations.hf import register_hf_attention
    register_hf_attention(mesh)                        # "context_parallel_ck" in transformers.AttentionInterface
    model = AutoModelForCausalLM.from_config(config, attn_implementation="context_parallel_ck")
    # every rank: its shard of input_ids, position_ids and the globally shifted labels (`shard_for_causal_lm`)
    loss = model(**shard_for_causal_lm(input_ids, mesh), use_cache=False).loss

The model's attention layers then call `context_parallel_sdpa` on their (b, h, s / W, d) projections: causal
over the whole sequence, GQA unexpanded, the layer's scaling and dropout. Everything else in the model works
per token, so it runs on the shard as it is, given the shard's global `position_ids` (RoPE). The causal LM loss
shifts labels inside the shard, which would pair tokens across chunk boundaries: `shard_for_causal_lm` shifts
them on the full sequence first (transformers' `shift_labels`) and passes `num_items_in_batch`, the group's
count of predicted tokens, so each rank's loss is its share of the global mean (sum them with an all-reduce;
the parameters' gradients likewise). One sequence per row: padding masks, packed documents (position_ids that
restart inside a row, `cu_seq_lens_*`) and what the attention cannot run (sliding windows, softcapping, sinks)
are refused with the argument named, never ignored.
"""

from __future__ import annotations

import torch

from ..core.errors import ArgumentError
from .context_parallel import context_parallel_sdpa, process_group, shard

NAME = "context_parallel_ck"    # no "flash" in it: transformers would try to load a flash-attn kernel of that name
IGNORE_INDEX = -100


def register_hf_attention(mesh_or_group=None, *, name: str = NAME, layout: str = "zigzag", kv_exchange: str = "ring",
                          backend: str | None = None) -> str:
    """Register context-parallel attention over `mesh_or_group` (a 1-D DeviceMesh, a ProcessGroup or None: the
    default group) as `name` in transformers' AttentionInterface and AttentionMaskInterface; returns `name`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    group = process_group(mesh_or_group)

    positions = {}      # (shard length, device) -> the global positions this rank's shard must have

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
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
        out = context_parallel_sdpa(query, key, value, group, is_causal=causal, scale=scaling,
                                    enable_gqa=key.shape[1] != query.shape[1], dropout_p=dropout, layout=layout,
                                    kv_exchange=kv_exchange, backend=backend)
        return out.transpose(1, 2), None       # transformers' attention functions return (b, s, h, d)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, flash_attention_mask)   # None without padding, as for flash-attn
    return name


# Options transformers passes to attention functions that this one cannot honour: refused, never ignored.
UNSUPPORTED_OPTIONS = {"sliding_window": "sliding-window attention", "softcap": "logit softcapping",
                       "s_aux": "attention sinks"}
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
