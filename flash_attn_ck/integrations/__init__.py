"""Integrations with PyTorch's own attention machinery; nothing here is imported by the package root.

- `sdpa`: flash_attn_ck as a provider of SDPA's flash-attention kernels
  (`torch.nn.attention.activate_flash_attention_impl("FLASH_ATTN_CK")` after importing it).
- `context_parallel`: ring attention over sequence shards on torch.distributed, for the (b, s, h, d) API.
- `hf`: Hugging Face transformers attention by name: context-parallel ("context_parallel_ck") and one-device
  ("ck_attention", padding and packing as varlen).

They all build on the SDPA provider, which needs torch >= 2.11 (its provider registry), the package's floor.
Where an older torch is installed anyway (`pip install --no-deps` into an image), importing any of them raises
an ImportError that says so.
"""

import torch.nn.attention

NEEDS_TORCH = "2.11"     # pyproject.toml's floor

if not hasattr(torch.nn.attention, "register_flash_attention_impl"):
    raise ImportError(f"flash_attn_ck.integrations (sdpa, torch_cp, context_parallel, hf) needs torch >= "
                      f"{NEEDS_TORCH} (torch.nn.attention.register_flash_attention_impl); this is torch "
                      f"{torch.__version__}")
