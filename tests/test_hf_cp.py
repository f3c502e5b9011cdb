"""A Hugging Face model with context-parallel attention by name (flash_attn_ck/integrations/hf.py), on CPU: a
small randomly initialised Llama (GQA 4/2, float64, no downloaded weights), gloo at world 2. Its loss and
every parameter's gradient with CP (each rank its shard; loss and gradients summed over the group) equal the
same model's with SDPA on the full sequence (to fp32 rounding: transformers takes the loss of fp32 logits)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.test_context_parallel import init, spawn, teardown

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _model(attn_implementation: str):
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    model.set_attn_implementation(attn_implementation)
    return model


def _worker(rank, world, port):
    from flash_attn_ck.integrations.hf import register_hf_attention, shard_for_causal_lm
    init(rank, world, port)
    try:
        input_ids = torch.randint(0, 61, (2, 4 * world), generator=torch.Generator().manual_seed(1))
        reference = _model("sdpa")
        loss = reference(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        for layout in ("zigzag", "contiguous"):
            model = _model(register_hf_attention(layout=layout, backend="reference"))
            local_loss = model(**shard_for_causal_lm(input_ids, layout=layout), use_cache=False).loss
            local_loss.backward()
            total = local_loss.detach().clone()
            dist.all_reduce(total)
            # transformers computes the loss from fp32 logits: the comparison holds to fp32 rounding.
            torch.testing.assert_close(total, loss.detach(), atol=0, rtol=1e-6)
            for (param_name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
                grad = ours.grad.clone()
                dist.all_reduce(grad)
                torch.testing.assert_close(grad, theirs.grad, atol=1e-7, rtol=1e-5,
                                           msg=lambda m, p=param_name: f"{layout} {p}: {m}")
    finally:
        teardown()


def test_llama_loss_and_gradients_equal_with_and_without_cp():
    """World 2 (world 3 passes too; left out to keep the CPU suite short: the attention itself is tested at 2-4)."""
    spawn(_worker, 2)
