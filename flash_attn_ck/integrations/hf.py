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
the parameters' gradients likewise). Padding masks are refused (pack sequences without padding instead).
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

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        if attention_mask is not None:
            raise ArgumentError(f"attention_mask: {name} takes unpadded sequences (the causal mask comes from "
                                "is_causal over the whole sequence); pack sequences without padding")
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        out = context_parallel_sdpa(query, key, value, group, is_causal=causal, scale=scaling,
                                    enable_gqa=key.shape[1] != query.shape[1], dropout_p=dropout, layout=layout,
                                    kv_exchange=kv_exchange, backend=backend)
        return out.transpose(1, 2), None       # transformers' attention functions return (b, s, h, d)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, flash_attention_mask)   # None without padding, as for flash-attn
    return name


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
