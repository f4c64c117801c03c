"""Build the bundled default model: a ~2.5M-parameter Llama and its BPE tokenizer, pretrained on
demo stories and generated tool-use conversations rendered as the agent runtime renders them.

Reproducible: the same arguments give the same files (fixed seeds, two threads; the hashes of a
build are written to ``build.json`` beside the weights). Run from the repo root:

    python scripts/build_default_model.py            # writes slm_align/assets/default-model/

The tokenizer keeps a call cheap: digits are single tokens (SmolLM's pre-tokenizer, which llama.cpp
knows as ``smollm``), and ``<tool_call>`` and ``</tool_call>`` are one token each (added, not special,
as Qwen2.5 ships them). It pretrains briefly on stories and conversations from generator seeds that the
quickstart's data does not use (calculator questions of the quickstart's tool tasks are left out), so
the base is fluent-ish, knows the call syntax, and SFT and RL still have something to teach.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from slm_align.data.agent_chats import conversation_text, generate_conversations
from slm_align.data.agent_tasks import leak_keys, split_tasks
from slm_align.data.demo_corpus import generate_stories
from slm_align.ondevice.templates.chat import CHATML_TEMPLATE

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CALL_TAGS = ["<tool_call>", "</tool_call>"]
QUICKSTART_TASKS = (400, 200)
"""The quickstart's tool tasks (train, held-out; seed 0): their questions stay out of pretraining."""


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False)])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer=trainer)
    # added after training, which would drop them
    core.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in CALL_TAGS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                        model_max_length=512)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def pretraining_texts(stories: int, conversations: int, seed: int) -> list[str]:
    """Stories and rendered conversations, interleaved in a seeded order."""
    train, heldout = split_tasks(*QUICKSTART_TASKS, seed=0)
    exclude = frozenset(leak_keys(train + heldout))
    chats = [conversation_text(chat, CHATML_TEMPLATE) for chat in generate_conversations(conversations, seed, exclude)]
    texts = generate_stories(stories, seed=seed) + chats
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed))
    return [texts[i] for i in order]


def file_hashes(out: Path) -> dict[str, str]:
    """sha256 of every file the build wrote."""
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(out.iterdir())
            if path.name != "build.json"}


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
    parser.add_argument("--conversations", type=int, default=6000)
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    texts = pretraining_texts(args.stories, args.conversations, args.seed)
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
    arguments = {name: str(value) for name, value in vars(args).items()}
    build = {"command": "python scripts/build_default_model.py", "arguments": arguments, "torch": torch.__version__,
             "sha256": file_hashes(args.out)}
    (args.out / "build.json").write_text(json.dumps(build, indent=2) + "\n")
    print(json.dumps(build["sha256"], indent=2))


if __name__ == "__main__":
    main()
