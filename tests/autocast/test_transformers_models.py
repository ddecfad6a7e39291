"""Real library code under both autocasts: small random-init Hugging Face models.

Built from configs (no downloads): GPT-2 with ``reorder_and_upcast_attn`` (a float32
island opened only when torch reports autocast), Llama, BERT and an MoE model (Ernie 4.5
MoE, whose router runs in a float32 island too). A training forward and backward under
``torch.autocast`` and under ``dispatch_amp.autocast`` must give bit-identical logits,
loss and gradients, with gradient checkpointing off and on.
"""

from __future__ import annotations

import os

import pytest
import torch

import dispatch_amp as amp

# transformers 5 renamed gradient_checkpointing_enable; the old name is what most code calls.
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")

if os.environ.get("CI") == "true":  # CI installs the test extra: these must run there
    import transformers
else:
    transformers = pytest.importorskip("transformers")


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=32, reorder_and_upcast_attn=True
    )
    return transformers.GPT2LMHeadModel(config)


def llama():
    config = transformers.LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, vocab_size=97, max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def bert():
    config = transformers.BertConfig(
        num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64,
        vocab_size=97, max_position_embeddings=32,
    )
    return transformers.BertForMaskedLM(config)


def ernie_moe():
    config = transformers.Ernie4_5_MoeConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, moe_intermediate_size=32, moe_num_experts=4, moe_k=2,
        vocab_size=97, max_position_embeddings=32,
    )
    return transformers.Ernie4_5_MoeForCausalLM(config)


MODELS = {"gpt2-upcast-attn": gpt2, "llama": llama, "bert": bert, "ernie4_5-moe": ernie_moe}

# Native's CPU table plus an op no model calls: the engine treats it as a policy of its
# own, switches native autocast off around every call, and so every cast is ours.
_LIBRARY = torch.library.Library("dispatch_amp_models", "DEF")
_LIBRARY.define("unused(Tensor x) -> Tensor")
POLICIES = {
    "builtin": None,
    "ours-alone": amp.Policy.for_device("cpu").with_ops(lower=["dispatch_amp_models::unused"]),
}


def train_step(build, region, checkpointing):
    torch.manual_seed(0)
    model = build().train()
    # Dropout off: both runs must see the same network, and RNG use may differ in order.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with region("cpu"):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.logits, out.loss, grads


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_step_is_bit_identical_to_native(name, checkpointing, policy):
    def ours(device_type):
        return amp.autocast(device_type, policy=POLICIES[policy])

    logits, loss, grads = train_step(MODELS[name], ours, checkpointing)
    want_logits, want_loss, want_grads = train_step(MODELS[name], torch.autocast, checkpointing)
    assert logits.dtype == want_logits.dtype and torch.equal(logits, want_logits)
    assert torch.equal(loss, want_loss), (loss.item(), want_loss.item())
    assert grads.keys() == want_grads.keys() and grads
    for key, grad in grads.items():
        assert torch.equal(grad, want_grads[key]), key


def test_gpt2_upcast_island_really_is_float32_under_ours():
    """The island must open under ours: attention weights come out float32 there."""
    torch.manual_seed(0)
    model = gpt2().eval()
    ids = torch.randint(0, 97, (1, 8))
    with amp.autocast("cpu"), torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True).attentions
    assert all(a.dtype == torch.float32 for a in attentions)
