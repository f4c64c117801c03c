"""Export verification decides by greedy equality for exact types and by top-1
agreement for quantized ones."""

import numpy as np
import pytest

from slm_align.export.publishing.parity import _torch_logits, verify
from slm_align.modeling.models import build_tiny_model


class NudgedBackend:
    """The PyTorch model itself, with one token pushed to the top at every 10th
    position of a sequence: a quantized artifact that agrees almost everywhere and
    still changes a few greedy choices."""

    n_ctx = 512
    eos_ids = ()

    def __init__(self, model, tokenizer, token: int):
        self.model = model
        self.tokenizer = tokenizer
        self.token = token
        self.ids: list[int] = []

    def tokenize(self, text, add_special=True):
        return self.tokenizer(text)["input_ids"]

    def reset(self):
        self.ids = []

    def feed_all(self, ids):
        self.ids = self.ids + list(ids)
        logits = _torch_logits(self.model, self.ids)
        nudged = np.arange(len(self.ids)) % 10 == 9
        logits[nudged, self.token] = logits[nudged].max(-1) + 10.0
        return logits[-len(ids):]

    def feed(self, ids):
        return self.feed_all(ids)[-1]


@pytest.fixture(scope="module")
def nudged(tokenizer):
    model = build_tiny_model("llama", len(tokenizer), hidden=64)
    return model, NudgedBackend(model, tokenizer, token=7)


def test_exact_types_fail_on_a_greedy_divergence(nudged, tokenizer):
    model, backend = nudged
    report = verify(model, tokenizer, backend, exact=True, min_agreement=0.5)
    assert report.divergences and not report.passed


def test_q8_reports_greedy_but_passes_on_agreement(nudged, tokenizer):
    model, backend = nudged
    report = verify(model, tokenizer, backend, exact=False, greedy=True, min_agreement=0.8)
    assert report.prompts == 4 and report.divergences  # measured and reported
    assert 0.8 <= report.agreement < 1.0 and report.passed
    strict = verify(model, tokenizer, backend, exact=False, greedy=True, min_agreement=0.95)
    assert not strict.passed


def test_low_bit_types_skip_greedy(nudged, tokenizer):
    model, backend = nudged
    report = verify(model, tokenizer, backend, exact=False, min_agreement=0.8)
    assert report.prompts == 0 and report.greedy_exact == 0 and report.passed
