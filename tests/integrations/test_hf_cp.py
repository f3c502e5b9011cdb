"""A Hugging Face model with context-parallel attention by name (flash_attn_ck/integrations/hf.py), on CPU: a
small randomly initialised Llama (GQA 4/2, float64, no downloaded weights), gloo at world 2. Its loss and
every parameter's gradient with CP (each rank its shard; loss and gradients summed over the group) equal the
same model's with SDPA on the full sequence (to fp32 rounding: transformers takes the loss of fp32 logits)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_context_parallel import init, spawn, teardown

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _model(attn_implementation: str):
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    model.set_attn_implementation(attn_implementation)
    return model


def _assert_same_gradients(model, reference, what):
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-7, rtol=1e-5,
                                   msg=lambda m, n=name: f"{what} {n}: {m}")


def _assert_cp_equals_the_full_sequence(model, reference, input_ids, what, layout="zigzag"):
    """`reference` on the full sequence, `model` on this rank's shard: the group's summed loss and gradients equal
    the reference's (transformers computes the loss from fp32 logits: the loss holds to fp32 rounding)."""
    from flash_attn_ck.integrations.context_parallel import sum_gradients
    from flash_attn_ck.integrations.hf import shard_for_causal_lm
    loss = reference(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    local_loss = model(**shard_for_causal_lm(input_ids, layout=layout), use_cache=False).loss
    local_loss.backward()
    total = local_loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, loss.detach(), atol=0, rtol=1e-6)
    sum_gradients(model.parameters())
    _assert_same_gradients(model, reference, what)


def _worker(rank, world, port):
    from flash_attn_ck.integrations.hf import register_hf_attention
    init(rank, world, port)
    try:
        input_ids = torch.randint(0, 61, (2, 4 * world), generator=torch.Generator().manual_seed(1))
        for layout in ("zigzag", "contiguous"):
            model = _model(register_hf_attention(layout=layout, backend="reference"))
            _assert_cp_equals_the_full_sequence(model, _model("sdpa"), input_ids, layout, layout)
    finally:
        teardown()


def test_llama_loss_and_gradients_equal_with_and_without_cp():
    """World 2 (world 3 passes too; left out to keep the CPU suite short: the attention itself is tested at 2-4)."""
    spawn(_worker, 2)


def _ddp_worker(rank, world, port):
    from torch.nn.parallel import DistributedDataParallel

    from flash_attn_ck.integrations.context_parallel import register_cp_comm_hook
    from flash_attn_ck.integrations.hf import register_hf_attention, shard_for_causal_lm
    init(rank, world, port)
    try:
        input_ids = torch.randint(0, 61, (2, 4 * world), generator=torch.Generator().manual_seed(1))
        reference = _model("sdpa")
        reference(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
        model = _model(register_hf_attention(backend="reference"))
        ddp = DistributedDataParallel(model)        # over the CP group: every rank holds a shard of each sequence
        register_cp_comm_hook(ddp)
        ddp(**shard_for_causal_lm(input_ids), use_cache=False).loss.backward()
        _assert_same_gradients(model, reference, "DDP")
    finally:
        teardown()


def test_ddp_over_the_cp_group_gives_the_full_sequence_gradients():
    """DDP over the CP group with `register_cp_comm_hook`: every parameter's gradient equals the single-process
    full-sequence one. Each rank's loss is a share of the global mean, so DDP's default average gives 1 / W of it."""
    spawn(_ddp_worker, 2)


def _refusal_worker(rank, world, port):
    from flash_attn_ck.core.errors import ArgumentError
    from flash_attn_ck.integrations.hf import register_hf_attention, shard_for_causal_lm
    init(rank, world, port)
    try:
        small = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8)
        input_ids = torch.randint(0, 61, (2, 4 * world), generator=torch.Generator().manual_seed(1))
        name = register_hf_attention(backend="reference")
        # What the layers ask for that this attention cannot run: refused with the option named, not ignored.
        for config, refusal in ((transformers.MistralConfig(**small, sliding_window=3),
                                 rf"^sliding_window: {name} runs sliding windows with kv_exchange='allgather' only"),
                                (transformers.Gemma2Config(**small, sliding_window=64, attn_logit_softcapping=30.0,
                                                           layer_types=["full_attention"] * 2),
                                 rf"^softcap: {name} does not run")):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config).double()
            model.set_attn_implementation(name)
            with pytest.raises(ArgumentError, match=refusal):
                model(**shard_for_causal_lm(input_ids), use_cache=False)
        # Packed documents: position_ids restarting inside a row would attend across documents.
        model = _model(name)
        kwargs = shard_for_causal_lm(input_ids)
        packed = kwargs["position_ids"].clone()
        packed[:, -1] = 0
        with pytest.raises(RuntimeError, match=r"^position_ids: expected this rank's shard"):
            model(**dict(kwargs, position_ids=packed), use_cache=False)
        with pytest.raises(ArgumentError, match=rf"^cu_seq_lens_q: {name} runs one sequence per row"):
            model(**kwargs, cu_seq_lens_q=torch.tensor([0, 2, 4 * world]), use_cache=False)
    finally:
        teardown()


def test_what_the_attention_cannot_run_is_refused_not_ignored():
    """A sliding window on the ring (Mistral), logit softcapping (Gemma2) and packed documents (position_ids
    restarting inside a row, cu_seq_lens) each raise, naming the argument; before, the model silently ran full
    causal attention."""
    spawn(_refusal_worker, 2)


def _sinks_and_windows_worker(rank, world, port):
    from flash_attn_ck.integrations.hf import register_hf_attention
    from hf_models import _model as small_model
    init(rank, world, port)
    softmax = torch.nn.functional.softmax      # eager's softmax kept in float64: an exact reference
    torch.nn.functional.softmax = lambda x, dim=None, _stacklevel=3, dtype=None: softmax(x, dim=dim)
    try:
        input_ids = torch.randint(1, 61, (2, 4 * world), generator=torch.Generator().manual_seed(1))
        name = register_hf_attention(kv_exchange="allgather", backend="reference")
        for kind in ("gpt_oss_sinks", "mistral_sliding"):
            _assert_cp_equals_the_full_sequence(small_model(kind, name), small_model(kind, "eager"), input_ids, kind)
    finally:
        torch.nn.functional.softmax = softmax
        teardown()


def test_sinks_and_sliding_windows_equal_the_full_sequence_with_the_allgather_exchange():
    """GPT-OSS (`s_aux` sinks on every layer, a window on every other one) and Mistral (a window shorter than the
    sequence on every layer) registered with kv_exchange="allgather": loss and every gradient, sinks' included,
    equal eager attention on the full sequence."""
    spawn(_sinks_and_windows_worker, 2)


def _compile_worker(rank, world, port):
    from flash_attn_ck.integrations.hf import register_hf_attention, shard_for_causal_lm
    init(rank, world, port)
    try:
        input_ids = torch.randint(0, 61, (2, 4 * world), generator=torch.Generator().manual_seed(1))
        kwargs = shard_for_causal_lm(input_ids)
        name = register_hf_attention(backend="reference")
        runs = []
        for compiled in (False, True):
            model = _model(name)
            forward = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
            loss = forward(**kwargs, use_cache=False).loss
            loss.backward()
            runs.append({"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}})
        eager, compiled = runs
        for what in eager:
            torch.testing.assert_close(compiled[what], eager[what], atol=1e-12, rtol=1e-10,
                                       msg=lambda m, w=what: f"{w}: {m}")
    finally:
        teardown()


def test_compiled_llama_with_cp_equals_eager():
    """torch.compile(fullgraph=True) of the model with the registered attention (which passes a ProcessGroup) runs
    and gives the eager loss and gradients; it raised UnsafeScriptObjectError where the group was probed by hasattr."""
    spawn(_compile_worker, 2)
