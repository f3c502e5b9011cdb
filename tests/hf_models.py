"""Small randomly initialised Hugging Face models (float64, no downloaded weights) and their inputs, for the
one-device attention tests on the CPU (tests/integrations/test_hf_local.py) and on a GPU
(tests/gpu/test_hf_local_gpu.py); eager attention's softmax kept in float64 (an autouse fixture for both)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 61
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             head_dim=8, max_position_embeddings=64, pad_token_id=0)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=4),
    "llama_gqa": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2),
    # a window shorter than the sequences, on every layer (Mistral's window includes the query's own key)
    "mistral_sliding": lambda: transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=3),
    "gemma2_softcap": lambda: transformers.Gemma2Config(**SMALL, num_key_value_heads=2, sliding_window=4,
                                                        attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                                        query_pre_attn_scalar=6,
                                                        layer_types=["sliding_attention", "full_attention"]),
    # attention sinks (`s_aux`: per-head `sinks`, set to sizeable logits in _model), GQA, a window on every other layer
    "gpt_oss_sinks": lambda: transformers.GptOssConfig(**SMALL, num_key_value_heads=2, sliding_window=4,
                                                       num_local_experts=4, num_experts_per_tok=2),
}

@pytest.fixture(autouse=True)
def eager_softmax_in_float64(monkeypatch):
    """Eager attention takes its softmax in float32 whatever the model's dtype; kept in float64 here, so that it is
    an exact reference for a float64 model and the tolerances stay at float64 rounding."""
    softmax = torch.nn.functional.softmax

    def float64_softmax(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", float64_softmax)


def _model(kind: str, attn_implementation: str):
    torch.manual_seed(0)
    # eager experts (MoE models): the grouped-mm kernels take no float64
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), experts_implementation="eager")
    model = model.double().eval()
    with torch.no_grad():       # initialised near 0; logits near a row's lse over its keys take a real share
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.copy_(torch.randn(module.sinks.shape, generator=torch.Generator().manual_seed(4)) + 1.5)
    model.set_attn_implementation(attn_implementation)
    return model


def _ids(*shape, seed=1):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _weights(shape, mask=None):
    weights = torch.randn(*shape, VOCAB, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return weights if mask is None else weights * mask[..., None]


DOCUMENT_LENGTHS = (5, 3, 6)


def _documents():
    return [_ids(1, n, seed=10 + i) for i, n in enumerate(DOCUMENT_LENGTHS)]


def _restarting_positions(documents):
    return torch.cat([torch.arange(d.shape[1]) for d in documents])[None]
