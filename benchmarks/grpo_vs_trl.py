"""GRPO: slm-align's loop vs TRL's GRPOTrainer, same model and settings, side by side in one run.

Both sides: the bundled Llama (or --model), a fresh LoRA (same rank, alpha, targets), fp32 on CPU,
the same prompts, G completions per prompt, the same completion length, temperature 1, beta (k3 KL
to the adapter-disabled reference), clip 0.2/0.28, loss "grpo", group scaling, and the same Python
reward. One *iteration* is: sample prompts_per_step x G completions, then `epochs` passes in
minibatches (TRL: steps_per_generation and num_iterations set to the same number of optimizer
steps). Each side runs in its own subprocess so peak RSS is its own; the first iteration is a
warm-up and is not timed. CPU seconds (the process's, all its threads) are printed beside wall-clock
seconds: on a busy host they move far less between runs, since a side that waits for a core spends
wall time but no CPU time.

Besides the totals it prints where an iteration's time goes: our loop's phases as it logs them
(``time/*`` in ``rl/metrics.jsonl``: sampling, reward, old and reference scoring, update forward and
backward) and what can be seen of TRL's from outside (its ``_generate``, ``_calculate_rewards`` and
``_generate_and_score_completions`` timed; the rest of the iteration is its update).

    python benchmarks/grpo_vs_trl.py                 # needs `pip install trl` (or TRL on
    PYTHONPATH) python benchmarks/grpo_vs_trl.py --iterations 5 --group-size 8 --max-new-tokens 64
    python benchmarks/grpo_vs_trl.py --device cuda --precision bf16   # both sides on the GPU, bf16
    forward passes python benchmarks/grpo_vs_trl.py --algo ppo      # our PPO's phases alone (TRL
    1.x ships no PPO trainer)
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sides import (  # noqa: E402
    StepStamps,
    add_side_arguments,
    alternate_sides,
    medians,
    print_rows,
    ran_as_side,
)

from slm_align.rl.llama_sampler import BASE_TYPES  # noqa: E402

LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
OUR_PHASES = ("sampler_sync", "sampling", "reward", "scoring_old", "scoring_ref", "update_forward", "update_backward")
SIDES = ("ours", "ours_llama", "trl")
"""ours: PyTorch samples; ours_llama: llama.cpp samples (rl.sampler = llama_cpp); trl: TRL's GRPOTrainer."""
LABELS = {"ours": "ours (torch)", "ours_llama": "ours (llama.cpp)", "trl": "TRL"}
TRL_PHASES = ("sampling", "reward", "scoring")
PHASE_ROWS = (("sampler_sync", "sampler: adapter swap"), ("sampling", "sampling"), ("reward", "reward"),
              ("scoring_old", "scoring: old log-probs"),
              ("scoring_ref", "scoring: reference log-probs"), ("scoring", "scoring: all"),
              ("update_forward", "update: forward"), ("update_backward", "update: backward + optimizer"),
              ("update", "update: all"), ("other", "other"))
"""The phase table's rows: (key, label); a side shows a dash for a phase it does not report."""


def reward(prompts, completions, **_):
    """Same reward on both sides: 1 inside a 20-40 word window (a verifiable, cheap reward)."""
    from slm_align.ondevice.rewards.builtin import length_window

    return length_window(prompts, completions, min_words=20, max_words=40)


def prompts_for(n: int) -> list[str]:
    from slm_align.config import DataSettings
    from slm_align.data.corpus import load_corpus
    from slm_align.data.prompts import prompts_of

    splits = load_corpus(DataSettings(demo_documents=2000), seed=0).splits
    prompts = prompts_of(splits.train)
    return [prompts[i % len(prompts)] for i in range(n)]


def build_ours(args):
    """Our GRPO (or PPO) loop at the benchmark's settings, ready for ``run_step``."""
    import torch

    from slm_align.config import GRPOSettings, LoraSettings, RLSettings
    from slm_align.envelope.policy import build_policy
    from slm_align.envelope.run import Placement
    from slm_align.envelope.value_head import ValueHead
    from slm_align.modeling.accelerator import resolve_device
    from slm_align.modeling.models import load_tokenizer, resolve_source
    from slm_align.rl.grpo import GRPO
    from slm_align.rl.learner import RolloutSource
    from slm_align.rl.ppo import PPO

    torch.set_num_threads(args.threads)
    source = resolve_source(args.model)
    tokenizer = load_tokenizer(source)
    settings = RLSettings(algo=args.algo, prompts_per_step=args.prompts, group_size=args.group_size,
                          max_new_tokens=args.max_new_tokens, epochs=args.epochs, minibatch_size=args.minibatch,
                          grpo=GRPOSettings(beta=args.beta, loss_type="grpo"), learning_rate=1e-5,
                          old_logprobs=args.old_logprobs,
                          lora=LoraSettings(r=LORA["r"], alpha=LORA["lora_alpha"], dropout=0.0,
                                            target_modules=LORA["target_modules"]))
    if args.side == "ours_llama":
        settings = settings.model_copy(update={"sampler": "llama_cpp", "sampler_base": args.sampler_base})
    policy = build_policy(source, None, settings, seed=0, device=resolve_device(args.device))
    prompts = prompts_for(args.prompts * (args.iterations + 1))
    rollouts = RolloutSource(prompts, sampler=llama_sampler(args, policy, tokenizer, source))
    placement = Placement(precision=args.precision)
    if args.algo == "ppo":  # the same number of samples: prompts x G prompt draws, one completion each
        value_head = ValueHead(policy.config.hidden_size).to(resolve_device(args.device))
        return PPO(policy, tokenizer, reward, rollouts, settings, seed=0, value_head=value_head, placement=placement)
    return GRPO(policy, tokenizer, reward, rollouts, settings, seed=0, placement=placement)


def llama_sampler(args, policy, tokenizer, source):
    """The llama.cpp sampler of the ``ours_llama`` side (None: PyTorch samples)."""
    if args.side != "ours_llama":
        return None
    import tempfile

    from slm_align.rl.llama_sampler import LlamaSampler

    folder = tempfile.mkdtemp(prefix="grpo-bench-sampler-")
    return LlamaSampler(policy, tokenizer, source, Path(folder), args.sampler_base, threads=args.threads, n_ctx=1024)


def run_ours(args) -> dict:
    loop = build_ours(args)
    times = []
    cpu = []
    logged = []
    for step in range(args.iterations + 1):
        started = time.perf_counter()
        cpu_started = time.process_time()
        logged.append(loop.run_step(step))
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    result = {"seconds_per_iteration": sum(times[1:]) / args.iterations,
              "cpu_seconds_per_iteration": sum(cpu[1:]) / args.iterations,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    for name in OUR_PHASES:
        result[f"phase/{name}"] = sum(metrics[f"time/{name}"] for metrics in logged[1:]) / args.iterations
    result["phase/scoring"] = result["phase/scoring_old"] + result["phase/scoring_ref"]
    result["phase/update"] = result["phase/update_forward"] + result["phase/update_backward"]
    phases = sum(result[f"phase/{name}"] for name in OUR_PHASES)
    result["phase/other"] = result["seconds_per_iteration"] - phases
    result["completion_tokens"] = sum(metrics["completion/length"] for metrics in logged[1:]) / args.iterations
    result["reward"] = sum(metrics["reward/mean"] for metrics in logged) / len(logged)
    if args.side == "ours_llama":
        for key in ("sampler/kl", "sampler/max_log_ratio", "sampler/capped_frac"):
            result[key] = max(metrics[key] for metrics in logged)
    return result


class CallTimer:
    """Wall-clock seconds of every call of some methods of an object (TRL's
    trainer), per method name."""

    def __init__(self, target, names: tuple[str, ...]):
        self.seconds: dict[str, list[float]] = {name: [] for name in names}
        self.results: dict[str, list] = {name: [] for name in names}
        for name in names:
            setattr(target, name, self._timed(name, getattr(target, name)))

    def _timed(self, name: str, method):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                result = method(*args, **kwargs)
            finally:
                self.seconds[name].append(time.perf_counter() - started)
            self.results[name].append(result)
            return result

        return timed

    def mean(self, name: str, skip: int = 1) -> float:
        """Mean seconds per call after the first ``skip`` calls (the warm-up iteration's)."""
        kept = self.seconds[name][skip:]
        return sum(kept) / len(kept) if kept else 0.0


def trl_phases(calls: CallTimer, seconds_per_iteration: float) -> dict:
    """What can be seen of TRL's iteration: sampling (``_generate``), reward
    (``_calculate_rewards``), scoring (the rest of ``_generate_and_score_completions``: old and
    reference log-probs, decoding), and the update (the rest)."""
    sampling = calls.mean("_generate")
    reward = calls.mean("_calculate_rewards")
    prepared = calls.mean("_generate_and_score_completions")
    lengths = [len(ids) for result in calls.results["_generate"][1:] for ids in result[1]]  # (prompts, completions, ..)
    return {"phase/sampling": sampling, "phase/reward": reward, "phase/scoring": prepared - sampling - reward,
            "phase/update": seconds_per_iteration - prepared, "phase/other": 0.0,
            "completion_tokens": sum(lengths) / len(lengths) if lengths else 0.0}


def reachable_backbone(model) -> None:
    """Let TRL find the decoder: TRL 1.x's fused LM head reads it as ``model.base_model`` (the
    attribute named by ``base_model_prefix``), which transformers 4.57's Gemma3ForCausalLM names
    ``language_model`` although its decoder is ``model``; without this TRL gets the causal LM itself
    back and fails on ``last_hidden_state``."""
    if not hasattr(model, model.base_model_prefix) and hasattr(model, "model"):
        model.base_model_prefix = "model"


def begins_with_bos(tokenizer) -> bool:
    """Whether the tokenizer puts a BOS before a text when it adds special tokens (as
    our sampler tokenizes)."""
    ids = tokenizer("Once upon a time", add_special_tokens=True)["input_ids"]
    return tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id


def trl_policy(model_source: str | None):
    """The tokenizer (left padding) and the model TRL's GRPOTrainer gets, from ``model_source``."""
    from slm_align.modeling.models import load_model, load_tokenizer, resolve_source

    source = resolve_source(model_source)
    tokenizer = load_tokenizer(source)
    tokenizer.padding_side = "left"
    # no token_type_ids: TRL hands the tokenizer's output to generate, which Gemma 3's
    # causal LM refuses them in
    tokenizer.model_input_names = [name for name in tokenizer.model_input_names if name != "token_type_ids"]
    model = load_model(source)
    reachable_backbone(model)
    return tokenizer, model


def run_trl(args) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    tokenizer, model = trl_policy(args.model)
    updates = args.prompts * args.group_size * args.epochs // args.minibatch  # optimizer steps per iteration
    clock = StepStamps()
    config = GRPOConfig(
        output_dir="/tmp/slm-align-bench-trl", use_cpu=args.device == "cpu", bf16=args.precision == "bf16",
        fp16=False, report_to=[],
        disable_tqdm=True, logging_steps=10_000, save_strategy="no", gradient_checkpointing=False,
        per_device_train_batch_size=args.minibatch,
        steps_per_generation=args.prompts * args.group_size // args.minibatch, num_iterations=args.epochs,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens, temperature=1.0, top_k=0,
        top_p=1.0, beta=args.beta, epsilon=0.2, epsilon_high=0.28, loss_type="grpo", scale_rewards="group",
        learning_rate=1e-5, max_steps=updates * (args.iterations + 1), seed=0, dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    # TRL tokenizes prompts without special tokens: the BOS our sampler's tokenizer adds
    # (Gemma's) is written in
    bos = tokenizer.bos_token if begins_with_bos(tokenizer) else ""
    prompts = [bos + prompt for prompt in prompts_for(args.prompts * (args.iterations + 1) * 4)]
    dataset = datasets.Dataset.from_dict({"prompt": prompts})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA),
                          callbacks=[clock.callback()])
    calls = CallTimer(trainer, ("_generate", "_calculate_rewards", "_generate_and_score_completions"))
    clock.start()
    trainer.train()
    seconds, cpu_seconds = clock.per_iteration(updates)
    return dict(trl_phases(calls, seconds), seconds_per_iteration=seconds, cpu_seconds_per_iteration=cpu_seconds,
                peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                optimizer_steps=len(clock.wall))


def print_phases(runs: dict[str, list[dict]]) -> None:
    """Seconds per iteration in each phase, median over each side's runs; a dash where
    a side does not see it."""
    print(f"{'phase (s per iteration)':30}" + "".join(f"{LABELS[side]:>18}" for side in runs))
    for key, label in PHASE_ROWS:
        cells = []
        for side in runs:
            values = [run[f"phase/{key}"] for run in runs[side] if f"phase/{key}" in run]
            cells.append(f"{statistics.median(values):18.2f}" if values else f"{'-':>18}")
        print(f"{label:30}{''.join(cells)}")


def print_sides(table: dict[str, dict[str, float]], rows: tuple[tuple[str, str, str], ...]) -> None:
    """One line per ``(key, label, format)``: each side's median, then each of our sides over TRL's."""
    ours = [side for side in table if side != "trl"]
    print(f"{'':30}" + "".join(f"{LABELS[side]:>18}" for side in table)
          + "".join(f"{LABELS[side] + ' / TRL':>28}" for side in ours))
    for key, label, form in rows:
        cells = "".join(f"{table[side][key]:18{form}}" for side in table)
        ratios = "".join(f"{table[side][key] / table['trl'][key]:28.2f}" if table["trl"][key] else f"{'-':>28}"
                         for side in ours)
        print(f"{label:30}{cells}{ratios}")


def print_ours_alone(runs: dict[str, list[dict]], args) -> None:
    """Our side's medians and phases, with no anchor beside it (PPO: TRL 1.x
    ships no PPO trainer)."""
    keys = ("seconds_per_iteration", "cpu_seconds_per_iteration", "peak_rss_mb", "completion_tokens")
    table = medians(runs, keys)["ours"]
    print(f"PPO (value head), {args.prompts * args.group_size} prompts x 1 completion, {args.max_new_tokens} new "
          f"tokens, {args.precision}, {args.device} ({args.threads} threads); median of {args.repeats} runs; no TRL "
          "side: TRL 1.x has no PPO trainer")
    for key in keys:
        print(f"{key.replace('_', ' '):30}{table[key]:12.2f}")
    for key, label in PHASE_ROWS:
        values = [run[f"phase/{key}"] for run in runs["ours"] if f"phase/{key}" in run]
        if values:
            print(f"{label:30}{statistics.median(values):12.2f}")


def add_loop_arguments(parser: argparse.ArgumentParser, threads: int) -> None:
    """The GRPO loop's settings, as this benchmark and ``grpo_profile.py`` build it."""
    parser.add_argument("--model", default=None, help="model source (default: the bundled model)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--minibatch", type=int, default=8)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--threads", type=int, default=threads)
    parser.add_argument("--old-logprobs", choices=["sampler", "recompute"], default="sampler",
                        help="our side's old log-probabilities: the sampler's, or a pass of their own (as before "
                             "2026-12-07, and as TRL)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=4)
    add_loop_arguments(parser, threads=2)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (both sides)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="forward passes (both sides)")
    parser.add_argument("--sampler", choices=["torch", "llama_cpp", "both"], default="torch",
                        help="our side's sampler: PyTorch, llama.cpp (rl.sampler = llama_cpp), or both sides")
    parser.add_argument("--sampler-base", choices=BASE_TYPES, default="source",
                        help="llama.cpp sampler: the type the policy's base GGUF is written in")
    parser.add_argument("--algo", choices=["grpo", "ppo"], default="grpo",
                        help="ppo: our PPO (value head) alone, its phases per iteration; TRL "
                             "1.x has no PPO trainer")
    parser.add_argument("--together", action="store_true",
                        help="run each round's sides at the same time (a busy host: compare CPU seconds)")
    add_side_arguments(parser, SIDES)
    args = parser.parse_args()
    if ran_as_side(args, run_ours, run_trl):
        return
    if args.algo == "ppo":
        print_ours_alone(alternate_sides(__file__, sys.argv[1:], args.repeats, sides=("ours",)), args)
        return
    ours = {"torch": ("ours",), "llama_cpp": ("ours_llama",), "both": ("ours", "ours_llama")}[args.sampler]
    runs = alternate_sides(__file__, sys.argv[1:], args.repeats, sides=ours + ("trl",), together=args.together)
    rows = (("seconds_per_iteration", "seconds per iteration", ".2f"),
            ("cpu_seconds_per_iteration", "CPU seconds per iteration", ".2f"),
            ("peak_rss_mb", "peak RSS (MB)", ".0f"), ("completion_tokens", "completion tokens (mean)", ".1f"),
            ("phase/sampling", "sampling (s per iteration)", ".2f"))
    table = medians(runs, tuple(key for key, _, _ in rows))
    print(f"GRPO, {args.prompts} prompts x G={args.group_size}, {args.max_new_tokens} new tokens, "
          f"LoRA r={LORA['r']}, {args.precision}, {args.device} ({args.threads} threads), "
          f"{args.iterations} timed iterations; median of {args.repeats} runs per side")
    if args.sampler == "torch":
        print_rows(table, rows[:4])
    else:
        print_sides(table, rows)
        for run in runs["ours_llama"]:
            print(f"llama.cpp sampler, base {args.sampler_base}: sampler/kl max {run['sampler/kl']:.2e}, "
                  f"max |log ratio| {run['sampler/max_log_ratio']:.3f}, capped {run['sampler/capped_frac']:.3f}")
    print_phases(runs)


if __name__ == "__main__":
    main()
