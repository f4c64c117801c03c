"""The sampled tokens' log-probabilities from the last hidden states, the vocabulary projection and log-softmax taken
a chunk of positions at a time, so that the full-vocabulary tensors of a whole minibatch never exist at once.

With a 262k vocabulary (Gemma 3) one minibatch of 8 x 64 completion tokens has 0.5 GB of logits in fp32; the
unchunked path held the logits, their temperature-scaled copy, the log-softmax and the entropy's two temporaries
alive together. Chunked, only the log-softmax (which its backward needs) is kept for the whole minibatch; the rest
lives one chunk at a time, in the forward and in the backward: the logits are dropped as soon as the log-softmax
exists, and the entropy takes one temporary, reused in place.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

CHUNK_POSITIONS = 128
"""Positions per chunk: (128, V) fp32 logits are 134 MB at V = 262k, 25 MB at 49k. On the real Gemma 3 270M (a
forward and backward of 8 x 46 tokens, 32 of them completion, 2 threads, each in its own process) the peak over the
loaded model was 2502 MB at 256 positions, 2245 MB at 128 and 2162 MB at 64, in 14.0, 14.5 and 14.7 CPU seconds."""

PLAIN_HEADS = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "gpt2", "gpt_neox", "smollm3"})
"""Architectures whose causal-LM logits are exactly the output projection of the decoder's last (normalised) hidden
state: no soft-capping, logit scale or bias. Any other falls back to the model's own logits."""


def plain_head(model) -> Optional[nn.Linear]:
    """The output projection of ``model`` (a causal LM, possibly inside a PEFT wrapper) when its logits are nothing
    more than that projection (:data:`PLAIN_HEADS`, a bias-free ``nn.Linear``), else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base.config.model_type not in PLAIN_HEADS:
        return None
    if getattr(base.config, "final_logit_softcapping", None) is not None:
        return None
    head = base.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    return head


def decoder_of(model):
    """The decoder stack under the causal-LM head (``model``, ``transformer``, ``gpt_neox``), PEFT unwrapped."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.base_model
    if decoder is base:  # a prefix that names no attribute (Gemma 3's "language_model"): transformers' own lookup
        decoder = base.get_decoder()
    if decoder is base:
        raise ValueError(f"no decoder stack found under {type(base).__name__}")
    return decoder


def token_logprobs(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, temperature: float,
                   with_entropy: bool, chunk: int = CHUNK_POSITIONS):
    """Log-probabilities of ``targets`` and (without gradient) the entropies, a chunk of positions at a time.

    Args:
        hidden: (N, H) last hidden states, the position before each target. head: the output projection W (V, H).
        targets: (N,) token ids. temperature: tau, the sampling temperature. chunk: positions per chunk.

    Returns:
        logprobs (N,) fp32, log softmax(W h_n / tau)[y_n]; entropies (N,) fp32, -sum_v p_v log p_v (None unless
        ``with_entropy``). The same formula as the unchunked path (log-softmax, then gather), chunk by chunk.
    """
    logprobs = []
    entropies = []
    for start in range(0, hidden.shape[0], chunk):
        logits = head(hidden[start:start + chunk]).float()
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        del logits  # log-softmax's backward needs its output only
        logprobs.append(logp.gather(-1, targets[start:start + chunk].unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            entropies.append(_entropy(logp.detach()))
    entropy = torch.cat(entropies) if with_entropy else None
    return torch.cat(logprobs), entropy


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """(n,) entropies -sum_v p_v log p_v of (n, V) log-probabilities, with one (n, V) temporary."""
    with torch.no_grad():
        product = logp.exp()
        product.mul_(logp)
        return -product.sum(-1)
