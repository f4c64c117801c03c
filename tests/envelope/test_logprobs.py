"""The chunked vocabulary projection and log-softmax (rl/logprobs.py) give the model's own
log-probabilities, entropies and values on every architecture, gradients included, and the first
ratio of a chunked update stays exactly 1."""

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from slm_align.config import LoraSettings, RLSettings
from slm_align.envelope.logprobs import _model_logprobs, forward_logprobs, plain_head, token_logprobs
from slm_align.envelope.value_head import ValueHead
from tests.helpers import ARCHITECTURES, policy_with_moved_lora

PROMPTS = ["Once upon a time, there was a cat.", "Tom found a red ball and", "One day,"]
COMPLETIONS = [" She ran to the park with her friend.",
               " kicked it.", " Mia was very happy to see the sun."]


def policy_with_trained_lora(path):
    """A tiny policy whose LoRA has moved off zero, so that the adapter changes
    the log-probabilities."""
    return policy_with_moved_lora(path, RLSettings(lora=LoraSettings(r=4, alpha=8.0, dropout=0.0)), 0.3, seed=0)


def left_padded(tokenizer):
    """(B, P+T) ids and mask: prompts padded on the left, completions on the right;
    and the prompt width P."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    completions = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in COMPLETIONS]
    width = max(map(len, prompts))
    length = max(map(len, completions))
    pad = tokenizer.pad_token_id
    ids = [[pad] * (width - len(p)) + p + c + [pad] * (length - len(c)) for p, c in zip(prompts, completions)]
    mask = [[0] * (width - len(p)) + [1] * (len(p) + len(c)) + [0] * (length - len(c))
            for p, c in zip(prompts, completions)]
    return torch.tensor(ids), torch.tensor(mask), width


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_logprobs_equal_the_models_own_to_1e_6_with_their_gradients(tiny_models, tokenizer, arch):
    policy = policy_with_trained_lora(tiny_models[arch])
    assert plain_head(policy) is not None  # every tested architecture takes the chunked path
    ids, mask, width = left_padded(tokenizer)
    value_head = ValueHead(policy.config.hidden_size)
    torch.nn.init.normal_(value_head.linear.weight)
    chunked = forward_logprobs(policy, ids, mask, width, 0.7, value_head, chunk=5)  # several chunks per row
    whole = _model_logprobs(policy, ids, mask, width, 0.7, value_head, True)
    for ours, theirs in zip(chunked, whole):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    lora = [p for n, p in policy.named_parameters() if "lora_A" in n]
    completion = mask[:, width:].float()
    grads = [torch.autograd.grad((logprobs * completion).sum(), lora) for logprobs, _, _ in (chunked, whole)]
    for ours, theirs in zip(*grads):  # the fused head forms its gradient in another order: fp32 rounding, ~1e-6
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert any(g.abs().max() > 0 for g in grads[0])


def test_a_head_that_is_more_than_a_projection_uses_the_models_logits(tiny_models):
    policy = policy_with_trained_lora(tiny_models["gemma3_text"])
    policy.get_base_model().config.final_logit_softcapping = 30.0
    assert plain_head(policy) is None


def test_the_fused_path_keeps_no_vocabulary_sized_tensor_and_weighs_each_row_by_its_own_gradient():
    torch.manual_seed(0)
    vocab = 97
    head = torch.nn.Linear(16, vocab, bias=False).requires_grad_(False)
    hidden = torch.randn(11, 16, requires_grad=True)
    targets = torch.randint(vocab, (11,))
    weights = torch.randn(11)  # a different d loss / d log p per row, as the clipped objective gives
    saved = []

    def keep_shape(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep_shape, lambda tensor: tensor):
        fused, entropy = token_logprobs(hidden, head, targets, 0.7, True, chunk=4)
    assert saved and all(vocab not in shape for shape in saved)  # (chunk, H) kept, never (chunk, V)
    (grad,) = torch.autograd.grad((fused * weights).sum(), hidden)
    logp = torch.log_softmax(head(hidden) / 0.7, dim=-1)  # autograd's own, unchunked
    expected_logprobs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (expected,) = torch.autograd.grad((expected_logprobs * weights).sum(), hidden)
    torch.testing.assert_close(fused, expected_logprobs.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1).detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    head.weight.requires_grad_(True)  # a trained head: autograd's path, which gives the head its gradient
    unfused, _ = token_logprobs(hidden, head, targets, 0.7, False, chunk=4)
    unfused.sum().backward()
    assert head.weight.grad is not None and head.weight.grad.abs().max() > 0


class VocabularyRows(TorchDispatchMode):
    """Records the most rows any tensor an operator produced had with the vocabulary as its last
    dimension (views left out: the head's transposed weight is not a new tensor)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for tensor in pytree.tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1 and tensor.shape[-1] == self.vocab:
                    self.most = max(self.most, tensor.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_each_chunk_size_gives_the_whole_heads_values_and_gradients_and_never_more_rows(tiny_models, tokenizer,
                                                                                        chunk):
    policy = policy_with_trained_lora(tiny_models["gemma3_text"])
    ids, mask, width = left_padded(tokenizer)  # 3 rows x T completion positions: 7 divides none of them evenly
    vocab = plain_head(policy).weight.shape[0]
    whole = _model_logprobs(policy, ids, mask, width, 0.7, None, True)
    seen = VocabularyRows(vocab)
    with seen:
        chunked = forward_logprobs(policy, ids, mask, width, 0.7, None, chunk=chunk)
        completion = mask[:, width:].float()
        lora = [p for n, p in policy.named_parameters() if "lora_B" in n]
        grads = torch.autograd.grad((chunked[0] * completion).sum(), lora)
    positions = completion.numel()
    assert positions % 7 and 0 < seen.most <= min(chunk, positions)  # one chunk's logits at a time, never B x T
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked[1], whole[1], rtol=1e-6, atol=1e-6)
    expected = torch.autograd.grad((whole[0] * completion).sum(), lora)
    for ours, theirs in zip(grads, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert any(g.abs().max() > 0 for g in grads)


def test_the_row_recorder_sees_the_whole_heads_logits(tiny_models, tokenizer):
    policy = policy_with_trained_lora(tiny_models["gemma3_text"])
    ids, mask, width = left_padded(tokenizer)
    seen = VocabularyRows(plain_head(policy).weight.shape[0])
    with seen, torch.no_grad():
        _model_logprobs(policy, ids, mask, width, 0.7, None, False)
    assert seen.most >= mask[:, width:].numel()  # B x T rows at once: what the chunked path never holds


@pytest.mark.parametrize("chunk", [3, 64])
def test_scoring_without_gradient_holds_one_chunk_of_logits(tiny_models, tokenizer, chunk):
    policy = policy_with_trained_lora(tiny_models["gemma3_text"])
    ids, mask, width = left_padded(tokenizer)
    seen = VocabularyRows(plain_head(policy).weight.shape[0])
    with seen, torch.no_grad():  # the old and reference passes' way
        scored, entropy, _ = forward_logprobs(policy, ids, mask, width, 1.0, None, with_entropy=False, chunk=chunk)
    assert entropy is None and 0 < seen.most <= chunk
    with torch.no_grad():
        whole, _, _ = _model_logprobs(policy, ids, mask, width, 1.0, None, False)
    torch.testing.assert_close(scored, whole, rtol=1e-6, atol=1e-6)
