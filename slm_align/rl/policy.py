"""The trainable policy: merged SFT weights + a fresh LoRA, a value head, and fp32 log-probabilities.

The reference policy is the same model with the adapter disabled: no second copy of the weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from slm_align.config import RLSettings
from slm_align.errors import UserError
from slm_align.rl.logprobs import CHUNK_POSITIONS, decoder_of, plain_head, token_logprobs


class ValueHead(nn.Module):
    """PPO's critic: a linear map from the policy's last hidden state to a scalar value, in fp32."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) hidden states in, (B, T) float32 values out (autocast off: values feed GAE in fp32)."""
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return self.linear(hidden.float()).squeeze(-1)


def require_trainable(model) -> int:
    """The envelope's hard check: refuse to train when no parameter requires grad (the silent freeze)."""
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if count == 0:
        raise UserError("no policy parameter requires grad: the LoRA adapter is frozen, so RL would silently "
                        "change nothing; keep merge-and-reinitialise on (do not pass --no-reinit-lora)")
    return count


def build_policy(source, sft_adapter: Optional[Path], settings: RLSettings, seed: int,
                 trust_remote_code: bool = False, allow_pickle: bool = False, device: str = "cpu"):
    """Merge the SFT adapter into the base and attach a fresh zero-initialised LoRA (the envelope's first part),
    in float32 on ``device``.

    With ``reinit_lora`` off, the SFT adapter is loaded as it is, the way PEFT loads it by default: frozen.
    """
    from slm_align.modeling import load_adapter, load_model, merged_policy
    from slm_align.training import attach_lora

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
    """Let the decoder layers checkpoint while RL stays in eval mode: transformers checkpoints a layer only when it is
    training, so the layers alone are marked as training; every module inside them (attention, dropout, LoRA
    dropout) stays in eval mode, so no dropout runs. Returns how many layers checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    for layer in layers:
        layer.training = True
    return len(layers)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` computes them."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def forward_logprobs(model, input_ids, attention_mask, prompt_width: int, temperature: float,
                     value_head: Optional[ValueHead] = None, with_entropy: bool = True, chunk: int = CHUNK_POSITIONS):
    """Per-token log-probabilities (fp32, at the sampling temperature), entropies (None unless ``with_entropy``;
    without gradient) and values of the completion.

    The vocabulary projection and log-softmax go ``chunk`` positions at a time (rl/logprobs.py) when the model's
    logits are a plain projection of its last hidden state; otherwise from the model's own logits."""
    head = plain_head(model)
    if head is None:
        return _model_logprobs(model, input_ids, attention_mask, prompt_width, temperature, value_head, with_entropy)
    last = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids(attention_mask), use_cache=False).last_hidden_state
    hidden = last[:, prompt_width - 1:-1]  # (B, T, H): the state before each completion token
    targets = input_ids[:, prompt_width:]
    logprobs, entropy = token_logprobs(hidden.reshape(-1, hidden.shape[-1]), head, targets.reshape(-1), temperature,
                                       with_entropy, chunk)
    if entropy is not None:
        entropy = entropy.view(targets.shape)
    values = value_head(hidden) if value_head is not None else None
    return logprobs.view(targets.shape), entropy, values


def _model_logprobs(model, input_ids, attention_mask, prompt_width: int, temperature: float,
                    value_head: Optional[ValueHead], with_entropy: bool):
    """:func:`forward_logprobs` from the model's own logits, all positions at once (a head that is more than a
    projection: soft-capping, scaling, bias)."""
    completion = input_ids.shape[1] - prompt_width
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                    output_hidden_states=value_head is not None, use_cache=False,
                    logits_to_keep=completion + 1)  # no vocabulary projection over the prompt
    logits = outputs.logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = input_ids[:, prompt_width:]
    logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():  # a statistic, not part of any loss: no graph over two more (B, T, V) tensors
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    values = None
    if value_head is not None:
        values = value_head(outputs.hidden_states[-1][:, prompt_width - 1:-1])
    return logprobs, entropy, values


@contextmanager
def merged_for_sampling(model):
    """Sample through plain linear layers: fold each LoRA delta into its base weight, restore exactly after.

    Sampling through peft's LoRA path costs about a quarter more time on small models; the original weights are
    cloned and copied back (not un-merged by subtraction, which would drift), so the reference is untouched.
    Log-probabilities for the update are always recomputed through the LoRA path.
    """
    from peft.tuners.lora import LoraLayer

    saved = []
    with torch.no_grad():
        try:
            for module in model.modules():
                if isinstance(module, LoraLayer) and not module.merged:
                    weight = module.get_base_layer().weight
                    saved.append((weight, weight.detach().clone()))
                    for name in module.active_adapters:
                        if name in module.lora_A:
                            weight.add_(module.get_delta_weight(name))
            with model.disable_adapter():
                yield model
        finally:
            for weight, value in saved:
                weight.copy_(value)


def policy_rewards(policy, tokenizer, reward_fn, prompts: list[str], settings: RLSettings, seed: int,
                   adapter: bool = True) -> list[float]:
    """Per-prompt reward of one completion sampled for each prompt with ``seed`` (the RL adapter on, merged for
    speed, or off: the prior), at the recipe's temperature and token budget."""
    from slm_align.generation import sample, score

    context = merged_for_sampling(policy) if adapter else policy.disable_adapter()
    with context:
        samples = sample(policy, tokenizer, prompts, settings.max_new_tokens, settings.temperature, seed=seed)
    return score(reward_fn, samples)
