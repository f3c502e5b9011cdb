"""Integrations with PyTorch's own attention machinery; nothing here is imported by the package root.

- `sdpa`: flash_attn_ck as a provider of SDPA's flash-attention kernels
  (`torch.nn.attention.activate_flash_attention_impl("FLASH_ATTN_CK")` after importing it).
- `context_parallel`: ring attention over sequence shards on torch.distributed, for the (b, s, h, d) API.
- `hf`: Hugging Face transformers attention by name: context-parallel ("context_parallel_ck") and one-device
  ("ck_attention", padding and packing as varlen).
"""
