"""A prompt opens with the tokenizer's BOS exactly once, in training and in the runtime alike: Gemma without its
<bos> is another input (SFT's calls came out of the runtime as a loop of <tool_call> lines)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from slm_align.data.encoding import encode, opening_ids
from slm_align.data.examples import Example
from slm_align.data.prompts import chat_prompt
from slm_align.modeling.models import ModelSource, load_tokenizer
from slm_align.ondevice.agent.loading import load_model
from slm_align.ondevice.agent.prompt import leading_ids, with_leading_ids
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.templates.chat import GEMMA_TEMPLATE

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
CHAT = [{"role": "user", "content": "Set a timer for ten minutes."}]


def bos_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer that puts <bos> before every text it tokenizes with its special tokens."""
    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2, "a": 3, "b": 4}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


def test_training_opens_a_sequence_with_one_bos_whether_or_not_the_text_writes_it():
    tokenizer = bos_tokenizer()
    assert opening_ids(tokenizer, "a b") == [0, 3, 4]
    assert opening_ids(tokenizer, "<bos> a b") == [0, 3, 4]  # the template wrote it: not a second one
    row = encode(Example(prompt="<bos> a", completion="b"), tokenizer, max_length=16)
    assert row["input_ids"] == [0, 3, 4, 1]
    whole = encode(Example(text="<bos> a b"), tokenizer, max_length=16)
    assert whole["input_ids"] == [0, 3, 4, 1]


class Words:
    """A runtime backend over :func:`bos_tokenizer` (tokenize only)."""

    def __init__(self, adds_bos: bool):
        self.tokenizer = bos_tokenizer()
        self.adds_bos = adds_bos

    def tokenize(self, text, add_special=True, special=True):
        return self.tokenizer(text, add_special_tokens=add_special and self.adds_bos)["input_ids"]


def test_the_runtime_opens_with_the_ids_the_tokenizer_puts_first_once():
    assert leading_ids(Words(adds_bos=True)) == [0]
    assert leading_ids(Words(adds_bos=False)) == []
    assert with_leading_ids([5, 6], [0]) == [0, 5, 6]
    assert with_leading_ids([0, 5, 6], [0]) == [0, 5, 6]
    assert with_leading_ids([5, 6], []) == [5, 6]


@pytest.mark.parametrize("template", ["gemma-turns", "gemma-3-it.jinja"])
def test_gemmas_runtime_prompt_is_the_prompt_sft_trained_on(real_gemma_gguf, template, tmp_path):
    """The runtime's ids for a chat equal training's (the tokenizer made from the same GGUF, the same template):
    one <bos> first, with the turns SFT gives a Gemma base (no <bos> written) and with Gemma's own template,
    which writes it."""
    tokenizer = load_tokenizer(ModelSource("gguf", str(real_gemma_gguf)))
    jinja = tmp_path / "template.jinja"
    jinja.write_text(GEMMA_TEMPLATE if template == "gemma-turns" else (TEMPLATES / template).read_text())
    model = load_model(real_gemma_gguf, threads=1, chat_template=str(jinja))
    runtime, _ = Agent(model.backend, model.sha256).prompt_tokens(CHAT, 16)
    tokenizer.chat_template = model.backend.chat_template
    trained = opening_ids(tokenizer, chat_prompt(CHAT, tokenizer))
    assert runtime[0] == tokenizer.bos_token_id and runtime[1] != tokenizer.bos_token_id
    assert runtime == trained
