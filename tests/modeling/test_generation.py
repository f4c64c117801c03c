"""How every stage samples (slm_align/modeling/generation.py): each token is an exact draw from the
softmax of the temperature-scaled (nucleus-filtered) logits, and the decoding loop continues a
left-padded batch with the KV cache exactly as transformers' ``generate`` does, on every
architecture we train."""

import math

import pytest
import torch

from slm_align.modeling.generation import draw_tokens, sample
from tests.helpers import ARCHITECTURES

PROBS = [0.5, 0.3, 0.15, 0.05, 0.0]
DRAWS = 200_000


def frequencies(tokens: torch.Tensor, vocab: int) -> list[float]:
    return (torch.bincount(tokens, minlength=vocab).double() / tokens.numel()).tolist()


def repeated_logits(probs: list[float]) -> torch.Tensor:
    """(DRAWS, V) logits whose softmax is ``probs`` (-inf for a zero), one row per draw."""
    row = torch.tensor([math.log(p) if p > 0 else -math.inf for p in probs], dtype=torch.float32)
    return row.expand(DRAWS, -1).contiguous()


def assert_close_frequencies(tokens: torch.Tensor, probs: list[float]) -> None:
    """Each token's frequency within 5 binomial standard errors of its probability."""
    for seen, p in zip(frequencies(tokens, len(probs)), probs):
        assert abs(seen - p) <= 5 * math.sqrt(max(p * (1 - p), 1e-12) / DRAWS), (seen, p)


def test_draws_follow_the_softmax_and_never_take_a_token_of_probability_zero():
    torch.manual_seed(0)
    tokens, logprobs = draw_tokens(repeated_logits(PROBS), temperature=1.0)
    assert_close_frequencies(tokens, PROBS)
    assert int((tokens == 4).sum()) == 0
    expected = torch.log(torch.tensor(PROBS[:4]))[tokens]
    assert torch.allclose(logprobs, expected, atol=1e-6)  # the log-probability of the drawn token, not another's


def test_a_leading_token_of_probability_zero_is_never_drawn():
    torch.manual_seed(1)
    tokens, _ = draw_tokens(repeated_logits([0.0, 0.0, 1.0]), temperature=1.0)
    assert torch.equal(tokens, torch.full((DRAWS,), 2))


def test_temperature_scales_the_logits_before_the_softmax():
    torch.manual_seed(2)
    tokens, logprobs = draw_tokens(repeated_logits(PROBS[:4]), temperature=0.5)
    sharpened = torch.softmax(torch.log(torch.tensor(PROBS[:4], dtype=torch.float64)) / 0.5, dim=-1).tolist()
    assert_close_frequencies(tokens, sharpened)
    assert sharpened[0] > 0.65  # far from the unscaled 0.5: a missing temperature fails
    assert torch.allclose(logprobs, torch.log(torch.tensor(sharpened, dtype=torch.float32))[tokens], atol=1e-5)


def test_the_nucleus_keeps_the_smallest_set_reaching_top_p_and_renormalises():
    torch.manual_seed(3)
    tokens, logprobs = draw_tokens(repeated_logits(PROBS[:4]), temperature=1.0, top_p=0.7)
    kept = [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]  # 0.5 + 0.3 reach 0.7
    assert_close_frequencies(tokens, kept)
    assert torch.allclose(logprobs, torch.log(torch.tensor(kept[:2]))[tokens], atol=1e-6)


def test_greedy_takes_the_argmax_and_the_raw_log_softmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    tokens, logprobs = draw_tokens(logits, temperature=0.0)
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_non_finite_logits_stop_the_sampler_instead_of_drawing_a_token():
    logits = torch.zeros(2, 5)
    logits[1, 3] = math.nan
    with pytest.raises(RuntimeError, match="non-finite logits"):
        draw_tokens(logits, temperature=1.0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_loop_continues_a_left_padded_batch_as_generate_does(tiny_models, tokenizer, arch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    prompts = ["Once upon a time, there was a little cat who liked to play in the "
               "garden with her friends.",
               "Tom found a red ball."]  # different lengths: the second is left-padded
    samples = sample(model, tokenizer, prompts, 24, temperature=0.0, with_logprobs=True)
    assert samples.prompt_mask[1, 0] == 0  # padding under test
    with torch.no_grad():
        expected = model.generate(input_ids=samples.prompt_ids, attention_mask=samples.prompt_mask, do_sample=False,
                                  max_new_tokens=24, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, output_scores=True,
                                  return_dict_in_generate=True)
    width = samples.prompt_ids.shape[1]
    generated = expected.sequences[:, width:width + samples.completion_ids.shape[1]]
    mask = samples.completion_mask.bool()
    assert int(mask.sum()) > 24  # past Gemma's sliding window of 8, with the cache
    assert torch.equal(samples.completion_ids[mask], generated[mask])
    scores = torch.log_softmax(torch.stack(expected.scores, dim=1).float(), -1)
    theirs = scores[:, :generated.shape[1]].gather(-1, generated.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(samples.logprobs[mask], theirs[mask], atol=1e-5)
