"""Sampling through merged weights samples the policy being trained: every LoRA kind folded (embedding adapters
included), and a target whose weight is tied to another module left on the LoRA path."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slm_align.envelope.policy import merged_for_sampling
from slm_align.modeling.models import build_tiny_model

IDS = torch.tensor([[5, 17, 3, 42, 8, 99, 23]])


def adapted(targets: list[str], tied: bool):
    """A tiny Llama (its head tied to the embedding or not), LoRA on ``targets``, every LoRA matrix moved."""
    model = build_tiny_model("llama", vocab_size=128)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.5)
    return policy.eval()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("targets", [["q_proj", "embed_tokens"], ["q_proj", "lm_head"], ["q_proj", "v_proj"]])
def test_logits_inside_the_sampling_context_are_the_adapted_policys(targets, tied):
    policy = adapted(targets, tied)
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    with torch.no_grad():
        expected = policy(IDS).logits
        with merged_for_sampling(policy) as sampling:
            inside = sampling(IDS).logits
        with policy.disable_adapter():
            prior = policy(IDS).logits
    assert not torch.allclose(expected, prior, atol=1e-3)  # the adapter changes the logits: a real check
    assert torch.allclose(inside, expected, atol=1e-4)  # and sampling sees exactly those
    assert all(torch.equal(p, before[name]) for name, p in policy.named_parameters())  # restored bit for bit
