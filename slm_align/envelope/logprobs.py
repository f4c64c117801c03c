"""The sampled tokens' log-probabilities from the last hidden states, the vocabulary projection and
log-softmax taken a chunk of positions at a time, so that the full-vocabulary tensors of a whole
minibatch never exist at once.

With a 262k vocabulary (Gemma 3) one minibatch of 8 x 64 completion tokens has 0.5 GB of logits in
fp32; the unchunked path held the logits, their temperature-scaled copy, the log-softmax and the
entropy's two temporaries alive together. Chunked, every full-vocabulary tensor lives one chunk at a
time: the logits are dropped as soon as the log-softmax exists, the entropy takes one temporary,
reused in place, and under a frozen head (LoRA) each chunk's gradient with respect to the hidden
states is formed in its forward (:class:`FusedLogprob`), so the backward keeps (N, H) per minibatch
instead of the (N, V) log-softmax.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from slm_align.envelope.value_head import ValueHead

CHUNK_POSITIONS = 128
"""Positions per chunk: (128, V) fp32 logits are 134 MB at V = 262k, 25 MB at 49k. On the real Gemma
3 270M (a forward and backward of 8 x 46 tokens, 32 of them completion, 2 threads, each in its own
process) the peak over the loaded model was 2502 MB at 256 positions, 2245 MB at 128 and 2162 MB at
64, in 14.0, 14.5 and 14.7 CPU seconds."""

PLAIN_HEADS = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "gpt2", "gpt_neox", "smollm3"})
"""Architectures whose causal-LM logits are exactly the output projection of the decoder's
last (normalised) hidden state: no soft-capping, logit scale or bias. Any other falls back to
the model's own logits."""


def plain_head(model) -> Optional[nn.Linear]:
    """The output projection of ``model`` (a causal LM, possibly inside a PEFT wrapper) when its
    logits are nothing more than that projection (:data:`PLAIN_HEADS`, a bias-free
    ``nn.Linear``), else None."""
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
    """The decoder stack under the causal-LM head (``model``, ``transformer``,
    ``gpt_neox``), PEFT unwrapped."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.base_model
    if decoder is base:  # a prefix that names no attribute (Gemma 3's "language_model"): transformers' own lookup
        decoder = base.get_decoder()
    if decoder is base:
        raise ValueError(f"no decoder stack found under {type(base).__name__}")
    return decoder


def token_logprobs(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, temperature: float,
                   with_entropy: bool, chunk: int = CHUNK_POSITIONS):
    """Log-probabilities of ``targets`` and (without gradient) the entropies, a
    chunk of positions at a time.

    Args:
        hidden: (N, H) last hidden states, the position before each target. head: the output
        projection W (V, H). targets: (N,) token ids. temperature: tau, the sampling temperature.
        chunk: positions per chunk.

    Returns:
        logprobs (N,) fp32, log softmax(W h_n / tau)[y_n]; entropies (N,) fp32, -sum_v p_v log
        p_v (None unless ``with_entropy``). The same formula as the unchunked path (log-softmax,
        then gather), chunk by chunk.

    When the gradient reaches ``hidden`` but not W (LoRA under a frozen head), each chunk is a
    :class:`FusedLogprob`: its gradient is formed in the forward and no (chunk, V) tensor outlives the chunk;
    otherwise autograd keeps each chunk's log-softmax for its backward.
    """
    fused = torch.is_grad_enabled() and hidden.requires_grad and not head.weight.requires_grad
    logprobs = []
    entropies = []
    for start in range(0, hidden.shape[0], chunk):
        rows = hidden[start:start + chunk]
        ys = targets[start:start + chunk]
        if fused:
            logprob, entropy = FusedLogprob.apply(rows, head.weight, ys, temperature, with_entropy)
        else:
            logprob, entropy = _chunk_logprobs(rows, head, ys, temperature, with_entropy)
        logprobs.append(logprob)
        entropies.append(entropy)
    entropy = torch.cat(entropies) if with_entropy else None
    return torch.cat(logprobs), entropy


def _scaled_logp(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n, V) fp32 log softmax(z / tau) of (n, V) logits."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def _picked(logp: torch.Tensor, ys: torch.Tensor, with_entropy: bool):
    """From a chunk's (n, V) log-softmax: (n,) log-probabilities of ``ys`` and (n,) entropies (None
    unless asked; without gradient). The caller makes ``logp`` from the logits, so that they are
    freed before the entropy's temporary exists."""
    logprob = logp.gather(-1, ys.unsqueeze(-1)).squeeze(-1)
    entropy = _entropy(logp.detach()) if with_entropy else None
    return logprob, entropy


def _chunk_logprobs(rows, head: nn.Linear, ys, temperature: float, with_entropy: bool):
    """One chunk through autograd: (n,) log-probabilities of ``ys`` and (n,)
    entropies (None unless asked)."""
    return _picked(_scaled_logp(head(rows), temperature), ys, with_entropy)


class FusedLogprob(torch.autograd.Function):
    """log p_n = log softmax(W h_n / tau)[y_n] for a chunk of rows, with its
    gradient formed in the forward.

    The gradient of one row's log-probability with respect to its hidden state is

        d log p_n / d h_n = (onehot(y_n) - p_n) W / tau = (W[y_n] - sum_v p_nv W[v]) / tau,
        p_n = softmax(W h_n / tau),

    (the softmax-cross-entropy gradient, as Liger's fused linear cross-entropy forms it), so the
    forward computes it, (n, V) x (V, H), and keeps only that (n, H) tensor; the backward scales row
    n by the incoming d loss / d log p_n (autograd applies that factor before the product instead:
    the two agree to fp32 rounding). The unfused path keeps the (n, V) log-softmax until its
    backward: 268 MB for 256 positions of Gemma 3's 262k vocabulary. W gets no gradient (this path
    is taken only when W is frozen); entropies carry none.

    Shapes: rows (n, H), weight (V, H), targets (n,) -> logprobs (n,) fp32, entropies (n,)
    fp32 (empty unless asked).
    """

    @staticmethod
    def forward(ctx, rows, weight, targets, temperature, with_entropy):
        logp = _scaled_logp(nn.functional.linear(rows, weight), temperature)
        logprob = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if with_entropy:  # p once: the entropy and the gradient both read it
            probs = logp.exp()
            entropy = -logp.mul_(probs).sum(-1)  # -sum_v p_v log p_v, in the log-softmax's place
        else:
            probs = logp.exp_()
            entropy = logprob.new_zeros(0)  # an autograd Function returns tensors only
        del logp
        residual = probs.neg_()  # -p, in its place
        residual.scatter_add_(-1, targets.unsqueeze(-1), torch.ones_like(logprob).unsqueeze(-1))  # onehot(y) - p
        gradient = (residual.to(weight.dtype) @ weight).float()  # (n, H): W[y] - p W, as autograd orders it
        del residual, probs
        if temperature != 1.0:
            gradient = gradient / temperature
        ctx.save_for_backward(gradient)
        ctx.rows_dtype = rows.dtype
        ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        (gradient,) = ctx.saved_tensors
        grad_rows = (grad_logprob.float().unsqueeze(-1) * gradient).to(ctx.rows_dtype)
        return grad_rows, None, None, None, None


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """(n,) entropies -sum_v p_v log p_v of (n, V) log-probabilities, with one (n, V) temporary."""
    with torch.no_grad():
        product = logp.exp()
        product.mul_(logp)
        return -product.sum(-1)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` computes them."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def forward_logprobs(model, input_ids, attention_mask, prompt_width: int, temperature: float,
                     value_head: Optional[ValueHead] = None, with_entropy: bool = True, chunk: int = CHUNK_POSITIONS):
    """Per-token log-probabilities (fp32, at the sampling temperature), entropies (None unless
    ``with_entropy``; without gradient) and values of the completion.

    The vocabulary projection and log-softmax go ``chunk`` positions at a time
    (:func:`token_logprobs`) when the model's logits are a plain projection of its last hidden
    state; otherwise from the model's own logits."""
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
    """:func:`forward_logprobs` from the model's own logits, all positions at once (a head that is
    more than a projection: soft-capping, scaling, bias)."""
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
