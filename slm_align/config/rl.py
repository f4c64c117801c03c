"""The settings of RL: PPO, GRPO, the safety envelope and the collapse watchdog, each field with its
bounds and a description (the CLI's help comes from it)."""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field, field_validator, model_validator

from slm_align.config.base import LoraSettings, Strict

MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
"""A dotted module name (``rl.environment_modules``, ``--environment-module``)."""


class EnvelopeSettings(Strict):
    """The safety envelope. Every guard is on by default; switching one off is
    explicit and recorded."""

    reinit_lora: bool = Field(True, description="Merge the SFT adapter and train a fresh "
                              "zero-initialised LoRA.")
    log_ratio_clamp: float = Field(20.0, gt=0,
                                   description="Clamp |log-ratio| before exp (float32).")
    sigma_clip: float = Field(3.0, ge=0, description="Clip scores and advantages at "
                                                     "this many std (0: off).")
    ratio_guard: float = Field(5.0, ge=0, description="Skip a minibatch whose mean ratio "
                                                      "exceeds this (0: off).")
    rollback: bool = Field(True, description="Restore params and optimizer state on a "
                                             "non-finite loss/grad/param.")
    max_consecutive_rollbacks: int = Field(5, ge=1, description="Stop the run after this "
                                                                "many rollbacks in a row.")
    grad_clip: float = Field(1.0, ge=0, description="Gradient-norm clip (0: off).")


class WatchdogSettings(Strict):
    """The collapse watchdog (``[rl.watchdog]``): a held-out probe keeps the best adapter; windowed
    detectors roll back to it with a lower learning rate, then stop early. A detector whose
    threshold is 0 is off."""

    enabled: bool = Field(True, description="Watch for the quiet collapses (reward drop, entropy "
                          "collapse, length inflation, KL runaway, starving groups, tool-use "
                          "collapse); off: publish the last adapter, recorded.")
    eval_every: int = Field(5, ge=1, description="Probe the held-out reward every this many "
                            "iterations (and at the start and the end); the best "
                            "probe's adapter is published.")
    probe_prompts: int = Field(16, ge=1, description="Held-out prompts of the probe, sampled once "
                               "each with the recipe's seed (common random numbers across probes).")
    window: int = Field(5, ge=1, description="Iterations per window: detectors compare the mean of "
                        "the last window with the mean of the first (and need both full).")
    reward_margin: float = Field(0.0, ge=0, description="Reward drop: the probe's mean paired drop "
                                 "below the best must exceed this many reward units ...")
    reward_z: float = Field(2.0, ge=0, description="... and be significant at the one-sided "
                            "level of this normal z (2: 2.3%), corrected for the number of earlier "
                            "probes (Bonferroni) and the probe's size (Student's "
                            "t) (0: reward drop off).")
    reward_patience: int = Field(2, ge=1, description="Reward drop: probes in a row below "
                                                      "the best before it fires.")
    entropy_floor: float = Field(0.3, ge=0, lt=1, description="Entropy collapse: window entropy "
                                 "below this fraction of the first window's (0: off).")
    length_ratio: float = Field(1.5, ge=0, description="Length inflation: window mean completion "
                                "length above this multiple of the first window's (0: off).")
    truncated_rise: float = Field(0.3, ge=0, description="Length inflation: window truncated "
                                  "fraction above the first window's plus this (0: off).")
    max_kl: float = Field(10.0, ge=0, description="KL runaway: window mean of the per-sequence KL "
                          "to the reference above this (nats; 0: off); the recovery also "
                          "raises the KL coefficient.")
    max_sampler_kl: float = Field(0.05, ge=0, description="Sampler mismatch runaway (rl.sampler = "
                                  "llama_cpp): window mean of the per-token KL of llama.cpp's "
                                  "sampling distribution from the trainer's above this (nats; 0: "
                                  "off).")
    zero_std_rise: float = Field(0.5, ge=0, description="GRPO starving: window share of all-equal "
                                 "groups above the first window's plus this (0: off).")
    call_rate_floor: float = Field(0.5, ge=0, lt=1, description="Tool-use collapse (agent "
                                   "episodes): window share of episodes with a tool call below "
                                   "this fraction of the first window's and significantly so (a "
                                   "pooled two-proportion test on the counts, corrected for the "
                                   "looks: at most 5% false alarms over a run) (0: off); watched "
                                   "once the first window holds 10 episodes that called.")
    valid_call_floor: float = Field(0.5, ge=0, lt=1, description="Tool-use collapse: window share "
                                    "of tool calls that parse and validate against the tool's "
                                    "schema below this fraction of the first window's (0: off).")
    lr_factor: float = Field(0.5, gt=0, lt=1, description="Each recovery multiplies the "
                                                          "learning rate by this.")
    kl_factor: float = Field(2.0, ge=1, description="A KL-runaway recovery multiplies the KL "
                             "coefficient (PPO kl_coef, GRPO beta) by this.")
    shaping_factor: float = Field(2.0, ge=1, description="A tool-use-collapse recovery multiplies "
                                  "the weight of the reward's call_format term "
                                  "(when it has one) by this.")
    max_recoveries: int = Field(2, ge=0, description="Rollbacks to the best before a further "
                                "trigger stops the run early (the best adapter published).")


class PPOSettings(Strict):
    """PPO's own settings (``[rl.ppo]``): the value loss, GAE, the KL
    penalty and reward whitening."""

    value_clip: float = Field(0.2, gt=0, description="PPO: clip of the value update.")
    value_coef: float = Field(0.5, ge=0, description="PPO: weight of the value loss.")
    gamma: float = Field(1.0, gt=0, le=1, description="PPO: discount.")
    lam: float = Field(0.95, ge=0, le=1, description="PPO: GAE lambda.")
    kl_coef: float = Field(0.05, ge=0,
                           description="PPO: KL coefficient (initial value when adaptive).")
    kl_mode: Literal["reward", "loss"] = Field("reward", description="PPO: k1 KL in the reward, or "
                                                                     "k3 in the loss.")
    adaptive_kl: bool = Field(False, description="PPO: adapt the KL coefficient toward target_kl.")
    target_kl: float = Field(0.1, gt=0, description="PPO: KL per sequence the "
                                                    "adaptive controller aims for.")
    whiten_rewards: bool = Field(True,
                                 description="PPO: whiten scores across the batch before use.")


class GRPOSettings(Strict):
    """GRPO's own settings (``[rl.grpo]``): the asymmetric clip, the KL weight,
    advantage scaling, the loss."""

    clip_eps_high: float = Field(0.28, gt=0, lt=1,
                                 description="GRPO: upper ratio clip (asymmetric).")
    beta: float = Field(0.04, ge=0, description="GRPO: coefficient of the k3 KL to the reference.")
    scale_rewards: Literal["group", "batch", "none"] = Field("group",
                                                             description="GRPO: advantage scaling.")
    loss_type: Literal["grpo", "dr_grpo", "token_mean"] = Field("grpo", description="GRPO: loss normalisation.")
    resample_zero_std: bool = Field(False, description="GRPO: resample groups whose "
                                                       "rewards are all equal (once).")
    refill_flat: int = Field(0, ge=0, le=8, description="GRPO, DAPO's dynamic sampling: replace "
                             "all-equal groups by groups of newly drawn training prompts, in at "
                             "most this many more draws an iteration (0: off); a group still "
                             "all-equal after them stays, with no signal.")


RL_SECTIONS = {"ppo": PPOSettings, "grpo": GRPOSettings}
"""The algorithm sections of ``[rl]``; their keys are also accepted flat (``[rl] beta
= 0.1``, ``rl.beta``)."""


GATE_CHOOSES = {"auto": ("ppo", "grpo")}
"""The ``algo`` names the headroom gate resolves (after SFT and the reward), and the algorithms
each may become."""


def gate_resolves(algo: str) -> bool:
    """Whether the headroom gate chooses the algorithm ``algo`` runs as (``auto``)."""
    return algo in GATE_CHOOSES


def algorithm_candidates(algo: str) -> tuple[str, ...]:
    """The algorithms ``algo`` may run as: itself, or for ``auto`` those the gate chooses among."""
    return GATE_CHOOSES.get(algo, (algo,))


def section_of(key: str) -> Optional[str]:
    """The ``[rl]`` sub-section that owns ``key`` ("ppo" or "grpo"), or None for a
    shared or unknown key."""
    for section, model in RL_SECTIONS.items():
        if key in model.model_fields:
            return section
    return None


def _given(section: Any) -> Any:
    """A sub-section's keys as given: a dict as it is, a settings object as the
    fields that were set on it."""
    if isinstance(section, BaseModel):
        return section.model_dump(include=section.model_fields_set)
    return section


class RLSettings(Strict):
    """PPO and GRPO: the shared settings here, each algorithm's own in ``ppo`` and
    ``grpo``; one envelope."""

    algo: Literal["ppo", "grpo", "auto", "dpo", "kto"] = Field("ppo", description="The algorithm; "
                                                               "auto follows the headroom gate's "
                                                               "recommendation (recorded in "
                                                               "headroom.json); dpo and kto "
                                                               "optimise the policy on "
                                                               "reward.preferences directly, no "
                                                               "reward model and no sampling "
                                                               "(settings in [preference]).")
    from_sft: bool = Field(True, description="Start from the run's SFT adapter (trained first when "
                           "missing); False: from the model as given (already fluent), which the "
                           "gate then measures as it is.")
    steps: int = Field(40, ge=1, description="Rollout-and-update iterations.")
    prompts_per_step: int = Field(4, ge=1, description="GRPO: prompts per iteration "
                                                       "(PPO: times group_size).")
    group_size: int = Field(8, ge=2, description="GRPO: completions per prompt (PPO: "
                                                 "one each, more prompts).")
    max_new_tokens: int = Field(48, ge=1, description="Most tokens per completion.")
    temperature: float = Field(1.0, gt=0,
                               description="Sampling temperature (logprobs use the same).")
    learning_rate: Optional[float] = Field(None, gt=0, lt=1, description="AdamW learning rate of "
                                           "LoRA (and value head); None: scaled to the model's "
                                           "size (slm_align/envelope/learning_rate.py).")
    warmup_steps: int = Field(0, ge=0, description="Iterations over which the learning rate rises "
                              "linearly to its value (iteration t of the first N at (t+1)/(N+1) of "
                              "it); 0: the full rate from the first update.")
    epochs: int = Field(2, ge=1, description="Passes over each rollout.")
    minibatch_size: int = Field(8, ge=1, description="Sequences per optimizer step.")
    micro_batch_size: Optional[int] = Field(
        8, ge=1, description="Sequences forwarded and backpropagated at once within a minibatch "
        "(None: the whole minibatch; 8 as TRL's per_device_train_batch_size). Smaller holds fewer "
        "activations; the gradients of the micro-batches add up to the minibatch's step, under its "
        "loss normaliser.")
    clip_eps: float = Field(0.2, gt=0, lt=1,
                            description="Ratio clip (PPO, and GRPO's lower bound).")
    mask_truncated: bool = Field(False, description="Give truncated completions no gradient.")
    length_penalty: float = Field(0.0, ge=0, description="Soft penalty per token past 80% of "
                                                         "max_new_tokens (in each round of an "
                                                         "agent episode).")
    missing_eos_penalty: float = Field(0.0, ge=0, description="Subtract from the score of a "
                                                              "completion without EOS (TRL's "
                                                              "missing_eos_penalty; 0: off).")
    save_steps: int = Field(10, ge=1, description="Checkpoint every this many "
                                                  "iterations (for --resume).")
    seed: Optional[int] = Field(None, description="Seeds RL's training draws (the fresh LoRA, the "
                                "prompt order, the rollouts); None: the recipe's seed. The split, "
                                "the held-out reward and the watchdog's probes keep the recipe's "
                                "seed (the SFT stage's, when RL takes a finished one), so runs "
                                "that differ only here are scored alike.")
    eval_prompts: int = Field(64, ge=1, description="Held-out prompts scored before and after RL.")
    report_prompts: int = Field(200, ge=0, description="Held-out prompts of the evaluation report "
                                                       "`train` ends with (0: no report; "
                                                       "`slm-align evaluate` writes it later).")
    episodes: Literal["auto", "on", "off"] = Field(
        "auto", description="Agent episodes: a rollout is a multi-turn episode run by the "
        "runtime's chat loop (calls, tool results, the final answer) when the task rows name tools "
        "or an environment (auto), always (on), or never (off: one completion per prompt).")
    max_tool_rounds: int = Field(3, ge=0, le=16, description="Agent episodes: tool rounds "
                                                             "before the final answer.")
    environment: Optional[str] = Field(None, description="Agent episodes: the environment class "
                                       "(module:Class) of every task row without an 'environment' "
                                       "column; its typed public methods are the tools.")
    environment_modules: list[str] = Field(
        default_factory=list, description="Agent episodes: the modules (dotted names; a package "
        "allows its submodules) whose classes a task row's 'environment' column may name. "
        "Importing a module runs its code, so a row naming any other module is refused before "
        "anything is imported; the module of the default environment class (rl.environment) needs "
        "no entry.")
    sampler: Literal["torch", "llama_cpp"] = Field(
        "torch", description="What draws the rollouts: PyTorch (the policy's own fp32 forward), or "
        "llama.cpp, the engine the device runs (single completions or agent episodes; the base as "
        "a GGUF once, the LoRA as an adapter GGUF each iteration), its tokens weighed by the "
        "truncated importance correction.")
    sampler_base: Literal["source", "F32", "F16", "Q8_0", "Q4_K_M"] = Field(
        "source", description="llama.cpp sampler: the base it runs. source: the model's own GGUF "
        "when it came from one (the SFT adapter applied before the policy's: what the device "
        "runs), else F16; or the policy's base written in that type.")
    sampler_cap: float = Field(2.0, gt=0, description="llama.cpp sampler: the cap C of the "
                                                      "importance weight pi_train / pi_sampler.")
    sampler_correction: Literal["token_truncate", "token_mask", "sequence_truncate",
                                "sequence_mask"] = Field(
        "token_truncate", description="llama.cpp sampler: a weight per token or per completion, "
        "truncated at the cap or zero above it (as TRL's vllm_importance_sampling_mode).")
    old_logprobs: Literal["sampler", "recompute"] = Field(
        "sampler", description="GRPO with several minibatches per epoch, PyTorch sampling in fp32: "
        "the old log-probabilities are the sampler's own (no pass of their own; they differ from a "
        "recomputation by fp32 rounding), or recomputed in a forward pass as TRL does.")
    ppo: PPOSettings = Field(default_factory=PPOSettings, description="PPO's own settings.")
    grpo: GRPOSettings = Field(default_factory=GRPOSettings, description="GRPO's own settings.")
    lora: LoraSettings = Field(default_factory=lambda: LoraSettings(r=16, alpha=32.0, dropout=0.0),
                               description="The fresh RL adapter.")
    envelope: EnvelopeSettings = Field(default_factory=EnvelopeSettings,
                                       description="The safety envelope.")
    watchdog: WatchdogSettings = Field(default_factory=WatchdogSettings,
                                       description="The collapse watchdog.")

    @model_validator(mode="before")
    @classmethod
    def _flat_keys_into_sections(cls, data: Any) -> Any:
        """Move a flat algorithm key (``beta``, as recipes and ``rl.beta`` overrides wrote it before
        the split) into its section; a key given both flat and in its section is refused. Unknown
        keys stay for extra="forbid"."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for section in RL_SECTIONS:
            flat = {key: data.pop(key) for key in list(data) if section_of(key) == section}
            if not flat:
                continue
            nested = _given(data.get(section, {}))
            if not isinstance(nested, dict):
                return data  # a section of the wrong type: pydantic names it
            for key in flat:
                if key in nested:
                    raise ValueError(f"rl.{key} and rl.{section}.{key} are both set; keep one "
                                     f"(rl.{section}.{key})")
            data[section] = {**nested, **flat}
        return data

    @field_validator("environment_modules")
    @classmethod
    def _module_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not MODULE_NAME.fullmatch(name):
                raise ValueError(f"environment module {name!r} is not a module name; give a dotted "
                                 "name such as my_envs or my_pkg.envs")
        return value

    @field_validator("report_prompts")
    @classmethod
    def _report_needs_two(cls, value: int) -> int:
        if value == 1:
            raise ValueError("a report compares at least 2 prompts (0 skips it)")
        return value
