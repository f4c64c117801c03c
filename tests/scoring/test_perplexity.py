import math

import torch

from slm_align.data.encoding import encode_all
from slm_align.data.examples import Example
from slm_align.modeling.models import build_tiny_model
from slm_align.scoring.perplexity import perplexity

DOCS = [Example(text="Once upon a time there was a cat."),
        Example(text="Tom found a red ball under a tree and was very happy with it all day long."),
        Example(prompt="Question: what did Mia find?", completion=" A shiny key."),
        Example(text="Hi.")]


def test_perplexity_does_not_depend_on_batch_size_or_padding(tokenizer):
    model = build_tiny_model("llama", len(tokenizer))
    encoded = encode_all(DOCS, tokenizer, max_length=64)
    results = [perplexity(model, encoded, tokenizer.pad_token_id, batch_size=b) for b in (1, 2, 4)]
    assert len({r.tokens for r in results}) == 1
    for r in results[1:]:
        assert math.isclose(r.ppl, results[0].ppl, rel_tol=1e-5)


def test_perplexity_is_token_weighted_and_skips_prompt_tokens(tokenizer):
    model = build_tiny_model("gpt2", len(tokenizer))
    encoded = encode_all(DOCS, tokenizer, max_length=64)
    by_hand_nll, by_hand_tokens = 0.0, 0
    with torch.no_grad():
        for row in encoded:
            ids = torch.tensor([row["input_ids"]])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            for pos, label in enumerate(row["labels"][1:]):
                if label != -100:
                    by_hand_nll -= float(logprobs[pos, label])
                    by_hand_tokens += 1
    result = perplexity(model, encoded, tokenizer.pad_token_id, batch_size=3)
    prompt_tokens = len(tokenizer("Question: what did Mia find?")["input_ids"])
    assert result.tokens == by_hand_tokens == sum(len(r["input_ids"]) - 1 for r in encoded) - prompt_tokens + 1
    assert math.isclose(result.ppl, math.exp(by_hand_nll / by_hand_tokens), rel_tol=1e-5)
