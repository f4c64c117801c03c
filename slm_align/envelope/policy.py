"""The trainable policy: merged SFT weights + a fresh LoRA (the trainable check refuses a frozen
one), gradient checkpointing in eval mode, and sampling from it with the adapter folded in or off.

The reference policy is the same model with the adapter disabled: no second copy of the weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from slm_align.config import RLSettings
from slm_align.errors import UserError
from slm_align.modeling.generation import sample, score
from slm_align.modeling.models import attach_lora, load_adapter, load_model, merged_policy


def require_trainable(model) -> int:
    """The envelope's hard check: refuse to train when no parameter requires
    grad (the silent freeze)."""
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if count == 0:
        raise UserError("no policy parameter requires grad: the LoRA adapter is frozen, so RL "
                        "would silently change nothing; keep merge-and-reinitialise on (do not "
                        "pass --no-reinit-lora)")
    return count


def build_policy(source, sft_adapter: Optional[Path], settings: RLSettings, seed: int,
                 trust_remote_code: bool = False, allow_pickle: bool = False, device: str = "cpu"):
    """Merge the SFT adapter into the base and attach a fresh zero-initialised LoRA (the envelope's
    first part), in float32 on ``device``.

    With ``reinit_lora`` off, the SFT adapter is loaded as it is, the way PEFT
    loads it by default: frozen.
    """
    if settings.envelope.reinit_lora or sft_adapter is None:
        merged = merged_policy(source, sft_adapter, trust_remote_code, allow_pickle)
        policy = attach_lora(merged, settings.lora, seed)
    else:
        policy = load_adapter(load_model(source, trust_remote_code, allow_pickle), sft_adapter, allow_pickle)
    require_trainable(policy)
    # eval mode throughout RL: no dropout in any forward (peft's new LoRA dropout too)
    return policy.float().to(device).eval()


def enable_checkpointing(model) -> None:
    """Gradient checkpointing without reentrant autograd (no input gradients needed under LoRA)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def checkpoint_in_eval(model) -> int:
    """Let the decoder layers checkpoint while RL stays in eval mode: transformers checkpoints a
    layer only when it is training, so the layers alone are marked as training; every module inside
    them (attention, dropout, LoRA dropout) stays in eval mode, so no dropout runs. Returns how
    many layers checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    for layer in layers:
        layer.training = True
    return len(layers)


@contextmanager
def merged_for_sampling(model):
    """Sample through plain layers: fold each LoRA delta (linear and embedding adapters alike) into its base
    weight, restore exactly after.

    Sampling through peft's LoRA path costs about a quarter more time on small models; the
    original weights are cloned and copied back (not un-merged by subtraction, which would
    drift), so the reference is untouched. The update's own log-probabilities always go through
    the LoRA path; GRPO's old ones may be the sampler's (``rl.old_logprobs``), equal to fp32
    rounding. A target whose weight another module shares (a tied head
    and embedding) cannot take its delta without changing the other: then sampling stays on the
    LoRA path, slower and exact.
    """
    from peft.tuners.lora import LoraLayer

    layers = [module for module in model.modules() if isinstance(module, LoraLayer) and not module.merged]
    shared = shared_weights(model)
    if any(id(layer.get_base_layer().weight) in shared for layer in layers):
        yield model
        return
    saved = []
    with torch.no_grad():
        try:
            for module in layers:
                weight = module.get_base_layer().weight
                saved.append((weight, weight.detach().clone()))
                for name in module.active_adapters:
                    if name in module.lora_A or name in module.lora_embedding_A:
                        weight.add_(module.get_delta_weight(name))
            with model.disable_adapter():
                yield model
        finally:
            for weight, value in saved:
                weight.copy_(value)


def shared_weights(model) -> set[int]:
    """The ids of weights that more than one plain module holds (tied input and output embeddings)."""
    from peft.tuners.lora import LoraLayer

    holders: dict[int, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and not isinstance(module, LoraLayer):
            holders[id(weight)] = holders.get(id(weight), 0) + 1
    return {key for key, count in holders.items() if count > 1}


def policy_rewards(policy, tokenizer, reward_fn, prompts: list[str], settings: RLSettings, seed: int,
                   adapter: bool = True) -> list[float]:
    """Per-prompt reward of one completion sampled for each prompt with ``seed`` (the RL adapter on,
    merged for speed, or off: the prior), at the recipe's temperature and token budget."""
    context = merged_for_sampling(policy) if adapter else policy.disable_adapter()
    with context:
        samples = sample(policy, tokenizer, prompts, settings.max_new_tokens, settings.temperature, seed=seed)
    return score(reward_fn, samples)
