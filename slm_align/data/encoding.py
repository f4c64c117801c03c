"""Turn examples into token ids and loss masks, the same way for SFT,
perplexity and later stages."""

from __future__ import annotations

from slm_align.data.examples import Example
from slm_align.data.prompts import chat_turn, render_chat

IGNORE_INDEX = -100


def render(example: Example, tokenizer) -> tuple[str, str]:
    """``(prompt, completion)`` text: the loss covers the completion only. Chats use
    the tokenizer's template."""
    if example.messages is not None:
        *history, last = example.messages
        if history and last["role"] == "assistant":
            return chat_turn(history, last, tokenizer, example.tools)
        return "", render_chat(example.messages, tokenizer, tools=example.tools)
    if example.prompt is not None:
        return example.prompt, example.completion or ""
    return "", example.text or ""


def opening_ids(tokenizer, text: str) -> list[int]:
    """``text``'s ids as it opens a sequence: with the tokenizer's special tokens (its BOS where it adds one),
    unless the text already opens with that BOS (a chat template that writes ``{{ bos_token }}``, as
    Gemma's and Llama 3's do): one BOS, never two. The runtime opens its prompts the same way
    (:func:`slm_align.ondevice.agent.prompt.with_leading_ids`)."""
    bos = tokenizer.bos_token
    written = bool(bos) and text.startswith(bos)
    return tokenizer(text, add_special_tokens=not written)["input_ids"]


def encode(example: Example, tokenizer, max_length: int) -> dict[str, list[int]]:
    """``input_ids`` and ``labels`` (prompt tokens masked with -100), EOS appended,
    truncated to ``max_length``."""
    prompt, completion = render(example, tokenizer)
    prompt_token_ids = opening_ids(tokenizer, prompt) if prompt else []
    if prompt_token_ids:  # BOS (when the tokenizer adds one) goes once, at the very start
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    else:
        completion_ids = opening_ids(tokenizer, completion)
    if tokenizer.eos_token_id is not None and (not completion_ids
                                               or completion_ids[-1] != tokenizer.eos_token_id):
        completion_ids = completion_ids + [tokenizer.eos_token_id]
    input_ids = (prompt_token_ids + completion_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_token_ids) + completion_ids)[:max_length]
    return {"input_ids": input_ids, "labels": labels}


def encode_all(examples: list[Example], tokenizer, max_length: int) -> list[dict[str, list[int]]]:
    """Encode every example, dropping those with no completion token left after truncation."""
    encoded = (encode(ex, tokenizer, max_length) for ex in examples)
    return [row for row in encoded if any(label != IGNORE_INDEX for label in row["labels"][1:])]


def pad_batch(rows: list[dict[str, list[int]]], pad_id: int):
    """Right-pad a batch: tensors ``input_ids``, ``attention_mask`` and
    ``labels`` (-100 on padding)."""
    import torch

    width = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.tensor(row["input_ids"])
        labels[i, :n] = torch.tensor(row["labels"])
        attention[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
