"""One-device Hugging Face attention by name ("ck_attention", flash_attn_ck/integrations/hf.py), on CPU with the
reference backend: small randomly initialised models (float64, no downloaded weights) give the same logits and
parameter gradients as transformers' eager attention, with padding, packed documents, a KV cache in generate()
and under torch.compile; what the attention cannot run is refused with the argument named."""

from __future__ import annotations

import pytest
import torch

from flash_attn_ck.core.errors import ArgumentError

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

from flash_attn_ck.integrations import hf  # noqa: E402
from flash_attn_ck.integrations.hf import register_hf_attention_local  # noqa: E402
from hf_models import (  # noqa: E402
    CONFIGS,
    _documents,
    _ids,
    _model,
    _restarting_positions,
    _weights,
    eager_softmax_in_float64,  # noqa: F401 (an autouse fixture)
)

NAME = register_hf_attention_local(backend="reference")
TOL = dict(atol=1e-10, rtol=1e-9)


def _logits_and_grads(model, weights, **inputs):
    """The logits and every parameter's gradient of sum(logits * weights) (weights zero on padded tokens)."""
    model.zero_grad()
    logits = model(**inputs, use_cache=False).logits
    (logits * weights).sum().backward()
    parameters = getattr(model, "_orig_mod", model).named_parameters()       # compiled: the model's own
    return logits.detach(), {name: p.grad.clone() for name, p in parameters if p.grad is not None}


def _assert_equal(ours, theirs, where=None):
    (ours_logits, ours_grads), (their_logits, their_grads) = ours, theirs
    keep = slice(None) if where is None else where
    torch.testing.assert_close(ours_logits[keep], their_logits[keep], **TOL)
    assert ours_grads.keys() == their_grads.keys()
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, their_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kind", CONFIGS)
def test_logits_and_gradients_equal_eager_without_padding(kind):
    input_ids = _ids(2, 9)
    runs = [_logits_and_grads(_model(kind, impl), _weights(input_ids.shape), input_ids=input_ids)
            for impl in (NAME, "eager")]
    _assert_equal(*runs)


@pytest.mark.parametrize("kind", CONFIGS)
def test_padding_unpads_to_varlen_and_equals_eager_on_real_tokens(kind):
    """Rows padded on the left and on the right: the real tokens' logits and all gradients equal eager's."""
    input_ids = _ids(3, 9)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0          # left padding
    mask[2, -2:] = 0         # right padding
    weights = _weights(input_ids.shape, mask)
    runs = [_logits_and_grads(_model(kind, impl), weights, input_ids=input_ids, attention_mask=mask)
            for impl in (NAME, "eager")]
    _assert_equal(*runs, where=mask.bool())


def _one_by_one(kind: str, documents):
    """Each document alone through eager: its logits, and the gradients of the summed losses."""
    model = _model(kind, "eager")
    weights = _weights((1, sum(d.shape[1] for d in documents)))
    logits, start = [], 0
    for doc in documents:
        out = model(input_ids=doc, use_cache=False).logits
        (out * weights[:, start:start + doc.shape[1]]).sum().backward()
        logits.append(out.detach())
        start += doc.shape[1]
    return torch.cat(logits, dim=1), {n: p.grad.clone() for n, p in model.named_parameters()}, weights


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sliding"])
def test_packed_documents_from_restarting_position_ids_equal_the_documents_one_by_one(kind):
    documents = _documents()
    *alone, weights = _one_by_one(kind, documents)
    packed = _logits_and_grads(_model(kind, NAME), weights, input_ids=torch.cat(documents, dim=1),
                               position_ids=_restarting_positions(documents))
    _assert_equal(packed, alone)


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sliding"])
def test_packed_documents_from_cu_seq_lens_equal_the_documents_one_by_one(kind, monkeypatch):
    """cu_seq_lens_q/k and max_length_q/k (DataCollatorWithFlattening's flash kwargs) are used as given: the
    positions are not read to find the documents."""
    def positions_read(*args):
        raise AssertionError("position_ids read although cu_seq_lens_q/k were given")

    monkeypatch.setattr(hf, "_lengths_from_positions", positions_read)
    documents = _documents()
    *alone, weights = _one_by_one(kind, documents)
    cu = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
    packed = _logits_and_grads(_model(kind, NAME), weights, input_ids=torch.cat(documents, dim=1),
                               position_ids=_restarting_positions(documents), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                               max_length_q=6, max_length_k=6)
    _assert_equal(packed, alone)


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sliding"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_generate_decodes_against_the_kv_cache_as_eager_does(kind, padded):
    """Greedy tokens equal eager's: the prompt, then steps of one query against the cache (bottom-right causal;
    Mistral's window shorter than the prompt)."""
    input_ids = _ids(2, 7)
    mask = torch.ones_like(input_ids)
    if padded:
        mask[1, :3] = 0
        input_ids = input_ids.masked_fill(mask == 0, 0)
    tokens = [_model(kind, impl).generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=5,
                                          do_sample=False) for impl in (NAME, "eager")]
    torch.testing.assert_close(tokens[0], tokens[1], atol=0, rtol=0)


def test_compiled_forward_fullgraph_equals_eager():
    model = _model("mistral_sliding", NAME)
    input_ids = _ids(2, 9)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ours = _logits_and_grads(compiled, _weights(input_ids.shape), input_ids=input_ids)
    _assert_equal(ours, _logits_and_grads(_model("mistral_sliding", "eager"), _weights(input_ids.shape),
                                          input_ids=input_ids))


def test_compiled_forward_refuses_restarting_position_ids_on_the_device():
    """Under compile the positions are not read on the host: restarting ones fail the device-side check."""
    compiled = torch.compile(_model("llama", NAME), backend="aot_eager", fullgraph=True)
    position_ids = torch.cat([torch.arange(5), torch.arange(4)])[None]
    with pytest.raises(RuntimeError, match="position_ids: restarting inside a row"):
        compiled(input_ids=_ids(1, 9), position_ids=position_ids, use_cache=False)


class _Layer(torch.nn.Module):
    is_causal = True


def _attention(**kwargs):
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    layer = _Layer()
    layer.train(kwargs.pop("training", False))
    attention = transformers.AttentionInterface._global_mapping[NAME]
    return attention(layer, q, q[:, :2], q[:, :2], kwargs.pop("attention_mask", None), **kwargs)[0]


def test_dropout_applies_only_while_the_module_trains():
    torch.testing.assert_close(_attention(dropout=0.5), _attention(dropout=0.0), atol=0, rtol=0)
    assert not torch.equal(_attention(dropout=0.5, training=True), _attention(dropout=0.0))


_PACKED = dict(max_length_q=6, max_length_k=6)


@pytest.mark.parametrize(("option", "kwargs"), [
    # options flash_attn_ck checks under its own names are named as the caller passed them, its name beside
    (r"s_aux \(learnable_sink\)", dict(s_aux=torch.zeros(3, dtype=torch.float64))),
    (r"scaling \(softmax_scale\)", dict(scaling=float("nan"))),
    (r"dropout \(dropout_p\)", dict(dropout=1.0, training=True)),
    ("output_attentions", dict(output_attentions=True)),
    ("block_table", dict(block_table=torch.zeros(1, 1, dtype=torch.int32))),
    ("attention_mask", dict(attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool))),
    ("attention_mask", dict(attention_mask=torch.ones(2, 6, dtype=torch.bool))),         # another batch
    ("attention_mask", dict(attention_mask=torch.ones(1, 7, dtype=torch.bool))),         # more keys than k's
    ("attention_mask", dict(attention_mask=torch.ones(1, 5, dtype=torch.bool))),         # fewer than the queries
    ("attention_mask", dict(attention_mask=torch.zeros(1, 6))),                          # an additive float mask
    ("attention_mask", dict(attention_mask=torch.tensor([[1, 1, 2, 1, 0, 0]]))),        # not 0/1
    ("sliding_window", dict(sliding_window=0)),
    ("sliding_window", dict(sliding_window=2.5)),
    ("position_ids", dict(position_ids=torch.arange(7)[None])),
    ("position_ids", dict(position_ids=torch.arange(6).repeat(2, 1))),
    ("max_length_q", dict(cu_seq_lens_q=torch.tensor([0, 6]), cu_seq_lens_k=torch.tensor([0, 6]))),
    ("cu_seq_lens_q", dict(cu_seq_lens_q=torch.tensor([0.0, 2.7, 6.0]), cu_seq_lens_k=torch.tensor([0, 3, 6]),
                           **_PACKED)),
])
def test_what_the_attention_cannot_run_is_refused_naming_the_argument(option, kwargs):
    with pytest.raises(ArgumentError, match=rf"^{option}: "):
        _attention(**kwargs)


def test_a_static_cache_without_its_mask_is_refused():
    """generate() drops an all-ones mask for implementations not named flash*; a static cache's unfilled keys would
    then be attended."""
    with pytest.raises(ArgumentError, match=r"^attention_mask: .* static KV cache"):
        _model("llama", NAME).generate(input_ids=_ids(1, 5), max_new_tokens=2, do_sample=False,
                                       cache_implementation="static")


@pytest.mark.parametrize("packed", [False, True], ids=["padding_mask", "restarting_positions"])
def test_the_host_reads_the_mask_or_positions_once_per_forward_not_per_layer(packed, monkeypatch):
    nonzero, calls = torch.Tensor.nonzero, []
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda t, *a, **kw: calls.append(t.shape) or nonzero(t, *a, **kw))
    inputs = dict(input_ids=_ids(1, 9), position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])) if packed else \
        dict(input_ids=_ids(2, 9), attention_mask=torch.tensor([[1] * 9, [0] * 3 + [1] * 6]))
    _model("llama", NAME)(**inputs, use_cache=False)
    assert len(calls) == 1, calls
