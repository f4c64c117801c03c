"""Build the bundled default model: a ~2.5M-parameter Llama and its BPE tokenizer,
pretrained on demo stories.

Reproducible: the same arguments give the same files (fixed seeds, one thread
order). Run from the repo root:

    python scripts/build_default_model.py            # writes slm_align/assets/default-model/

It pretrains only briefly on stories from a generator seed that the quickstart's SFT data does not
use, so the base is fluent-ish and SFT still has something to teach.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from slm_align.chat_templates import CHATML_TEMPLATE
from slm_align.data.demo_corpus import generate_stories

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts + ["<|im_start|>user\nHi<|im_end|>\n"], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                        model_max_length=512)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def packed_batches(tokenizer, texts: list[str], seq_len: int, batch: int, generator: torch.Generator):
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])
    usable = len(ids) // seq_len * seq_len
    rows = torch.tensor(ids[:usable]).view(-1, seq_len)
    while True:
        order = torch.randperm(rows.shape[0], generator=generator)
        for start in range(0, len(order) - batch + 1, batch):
            yield rows[order[start:start + batch]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("slm_align/assets/default-model"))
    parser.add_argument("--stories", type=int, default=6000)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    texts = generate_stories(args.stories, seed=args.seed)
    tokenizer = build_tokenizer(texts, vocab_size=1024)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=192, intermediate_size=512, num_hidden_layers=6,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    batches = packed_batches(tokenizer, texts, seq_len=128, batch=32,
                             generator=torch.Generator().manual_seed(args.seed))
    start = time.time()
    for step in range(args.steps):
        batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f} ppl {math.exp(loss.item()):.2f} "
                  f"{time.time() - start:.0f}s",
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     max_new_tokens=64).save_pretrained(args.out)


if __name__ == "__main__":
    main()
