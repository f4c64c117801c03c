"""Typed recipe: every setting of every stage, loaded from TOML and overridden by CLI flags."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from slm_align.errors import UserError
from slm_align.tomlcompat import tomllib


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSettings(_Strict):
    source: Optional[str] = Field(None, description="HF directory, hub id or .gguf file; None = "
                                  "the bundled model.")
    trust_remote_code: bool = Field(False, description="Run code shipped with a hub model (off "
                                    "unless asked).")
    allow_pickle: bool = Field(False, description="Accept pickle (.bin) checkpoints (unsafe; off "
                               "unless asked).")


class ComputeSettings(_Strict):
    """Where and how the training stages compute (``[compute]``); the envelope's math is
    float32 whatever is set."""

    device: str = Field("auto", description="auto (the CUDA GPU, else Apple's MPS, else the CPU), "
                        "cpu, cuda, cuda:N or mps.")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Forward passes of the "
                                                       "training stages: fp32, or bf16/fp16 "
                                                       "autocast (fp16 on CUDA only); "
                                                       "log-probabilities, ratios, advantages and "
                                                       "KL stay fp32.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward "
                                         "pass (SFT, reward, RL, DPO/KTO): less memory, about a "
                                         "third more compute.")
    load_in_4bit: bool = Field(False, description="QLoRA: NF4 4-bit base weights (bitsandbytes) "
                               "for SFT; CUDA only (refused elsewhere and by the other stages).")
    deepspeed: Optional[str] = Field(None, description="DeepSpeed config of the Trainer stages "
                                     "(SFT, reward model), passed to TrainingArguments: zero2 (the "
                                     "bundled ZeRO-2 config) or a JSON file; CUDA and pip install "
                                     "deepspeed needed; refused by RL, DPO and KTO.")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", value) is None:
            raise ValueError("choose auto, cpu, cuda, cuda:N or mps")
        return value


DEMO = "demo"
"""``data.path`` (``--data demo``) naming the generated demo stories; a file
named demo is ``./demo``."""


class DataSettings(_Strict):
    path: Optional[str] = Field(None, description="Corpus file, datasets directory or hub dataset "
                                "id; demo: the generated demo stories (./demo for a file of that "
                                "name). sft, check-headroom and train refuse to run without it "
                                "unless the data comes from a finished SFT stage.")
    tasks: Optional[str] = Field(None, description="Task file for RL, the gate's reward spread and "
                                 "evaluation: a prompt column (text or chat messages) and any "
                                 "others (answer, tools, ...), which reach the reward functions as "
                                 "keyword lists; jsonl, json, parquet or a datasets directory. "
                                 "None: prompts are the openings of the corpus's held-out "
                                 "documents.")
    text_field: Optional[str] = Field(None, description="Column holding the text; found "
                                      "automatically when None.")
    demo_documents: int = Field(2000, ge=10, description="How many demo stories to generate "
                                "(data.path demo).")
    eval_fraction: float = Field(0.1, gt=0.0, lt=0.5, description="Share of documents kept for "
                                 "evaluation.")
    heldout_prompts: int = Field(200, ge=1, description="Most documents kept back as held-out "
                                 "prompts.")
    max_length: int = Field(256, ge=8, le=32768, description="Tokens per training sequence (longer "
                            "is truncated).")

    @property
    def uses_demo(self) -> bool:
        """Whether the corpus is the demo stories: named (``demo``) or left unset by a
        caller of the library."""
        return self.path is None or self.path == DEMO


class LoraSettings(_Strict):
    r: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: Optional[list[str]] = Field(None, description="Modules to adapt; None = per "
                                                "architecture.")


class TrainSettings(_Strict):
    """Optimizer and schedule settings shared by the stages that run on transformers' Trainer."""

    epochs: float = Field(1.0, gt=0, description="Passes over the training data.")
    max_steps: int = Field(-1, ge=-1, description="Stop after this many optimizer steps (-1: use "
                           "epochs).")
    learning_rate: float = Field(2e-3, gt=0, lt=1, description="Peak learning rate of the cosine "
                                 "schedule.")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="Share of steps spent warming up.")
    batch_size: int = Field(8, ge=1, description="Sequences (SFT) or pairs (reward) per device "
                            "batch.")
    grad_accum: int = Field(1, ge=1, description="Batches accumulated per optimizer step.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    save_steps: int = Field(50, ge=1, description="Checkpoint every this many steps (for "
                            "--resume).")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="The adapter.")


class SFTSettings(TrainSettings):
    neftune_alpha: Optional[float] = Field(5.0, ge=0, description="NEFTune noise scale; None or 0 "
                                           "disables it.")


class PairSettings(_Strict):
    mix: dict[str, float] = Field(default_factory=lambda: {"truncate": 1.0, "shuffle": 1.0, "mismatch": 1.0,
                                                           "dropout": 1.0},
                                  description="Relative weight of each corruption that makes a "
                                  "rejected text.")
    opening_sentences: int = Field(2, ge=1, description="Sentences of a document that form the "
                                   "prompt.")
    min_words: int = Field(3, ge=1, description="Pairs whose chosen or rejected side has fewer "
                           "words are dropped.")
    dropout_rate: float = Field(0.3, gt=0, lt=1, description="Share of words removed by the "
                                "dropout corruption.")
    synthetic: bool = Field(True, description="Build pairs from the corpus (besides any imported "
                            "preferences).")


class RewardSettings(TrainSettings):
    learning_rate: float = Field(1e-3, gt=0, lt=1, description="Peak learning rate of the cosine "
                                 "schedule.")
    margin: float = Field(0.0, ge=0, description="Bradley-Terry margin: chosen must beat rejected "
                          "by this much.")
    center_coefficient: float = Field(0.01, ge=0, description="Weight of the (r_chosen + "
                                      "r_rejected)^2 penalty.")
    pairs: PairSettings = Field(default_factory=PairSettings, description="Synthetic preference "
                                "pairs.")
    preferences: list[str] = Field(default_factory=list,
                                   description="Preference files to import (TRL columns), e.g. "
                                               "both files of `slm-align feedback export`.")

    @field_validator("preferences", mode="before")
    @classmethod
    def _one_or_many(cls, value):
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        return value


class EnvelopeSettings(_Strict):
    """The safety envelope. Every guard is on by default; switching one off is
    explicit and recorded."""

    reinit_lora: bool = Field(True, description="Merge the SFT adapter and train a fresh "
                              "zero-initialised LoRA.")
    log_ratio_clamp: float = Field(20.0, gt=0, description="Clamp |log-ratio| before exp "
                                   "(float32).")
    sigma_clip: float = Field(3.0, ge=0, description="Clip scores and advantages at this many std "
                              "(0: off).")
    ratio_guard: float = Field(5.0, ge=0, description="Skip a minibatch whose mean ratio exceeds "
                               "this (0: off).")
    rollback: bool = Field(True, description="Restore params and optimizer state on a non-finite "
                           "loss/grad/param.")
    max_consecutive_rollbacks: int = Field(5, ge=1, description="Stop the run after this many "
                                           "rollbacks in a row.")
    grad_clip: float = Field(1.0, ge=0, description="Gradient-norm clip (0: off).")


class WatchdogSettings(_Strict):
    """The collapse watchdog (``[rl.watchdog]``): a held-out probe keeps the best adapter; windowed
    detectors roll back to it with a lower learning rate, then stop early. A detector whose
    threshold is 0 is off."""

    enabled: bool = Field(True, description="Watch for the quiet collapses (reward drop, entropy "
                          "collapse, length inflation, KL runaway, starving groups, tool-use "
                          "collapse); off: publish the last adapter, recorded.")
    eval_every: int = Field(5, ge=1, description="Probe the held-out reward every this many "
                            "iterations (and at the start and the end); the best probe's adapter "
                            "is published.")
    probe_prompts: int = Field(16, ge=1, description="Held-out prompts of the probe, sampled once "
                               "each with the recipe's seed (common random numbers across probes).")
    window: int = Field(5, ge=1, description="Iterations per window: detectors compare the mean of "
                        "the last window with the mean of the first (and need both full).")
    reward_margin: float = Field(0.0, ge=0, description="Reward drop: the probe's mean paired drop "
                                 "below the best must exceed this many reward units ...")
    reward_z: float = Field(2.0, ge=0, description="... and be significant at the one-sided "
                            "level of this normal z (2: 2.3%), corrected for the number of earlier "
                            "probes (Bonferroni) and the probe's size (Student's t) (0: reward drop "
                            "off).")
    reward_patience: int = Field(2, ge=1, description="Reward drop: probes in a row below the best "
                                 "before it fires.")
    entropy_floor: float = Field(0.3, ge=0, lt=1, description="Entropy collapse: window entropy "
                                 "below this fraction of the first window's (0: off).")
    length_ratio: float = Field(1.5, ge=0, description="Length inflation: window mean completion "
                                "length above this multiple of the first window's (0: off).")
    truncated_rise: float = Field(0.3, ge=0, description="Length inflation: window truncated "
                                  "fraction above the first window's plus this (0: off).")
    max_kl: float = Field(10.0, ge=0, description="KL runaway: window mean of the per-sequence KL "
                          "to the reference above this (nats; 0: off); the recovery also raises "
                          "the KL coefficient.")
    zero_std_rise: float = Field(0.5, ge=0, description="GRPO starving: window share of all-equal "
                                 "groups above the first window's plus this (0: off).")
    call_rate_floor: float = Field(0.5, ge=0, lt=1, description="Tool-use collapse (agent "
                                   "episodes): window share of episodes with a tool call below "
                                   "this fraction of the first window's (0: off); watched only when "
                                   "the first window's share is above 0.05.")
    valid_call_floor: float = Field(0.5, ge=0, lt=1, description="Tool-use collapse: window share "
                                    "of tool calls that parse and validate against the tool's "
                                    "schema below this fraction of the first window's (0: off).")
    lr_factor: float = Field(0.5, gt=0, lt=1, description="Each recovery multiplies the learning "
                             "rate by this.")
    kl_factor: float = Field(2.0, ge=1, description="A KL-runaway recovery multiplies the KL "
                             "coefficient (PPO kl_coef, GRPO beta) by this.")
    shaping_factor: float = Field(2.0, ge=1, description="A tool-use-collapse recovery multiplies "
                                  "the weight of the reward's call_format term (when it has one) "
                                  "by this.")
    max_recoveries: int = Field(2, ge=0, description="Rollbacks to the best before a further "
                                "trigger stops the run early (the best adapter published).")


class PPOSettings(_Strict):
    """PPO's own settings (``[rl.ppo]``): the value loss, GAE, the KL
    penalty and reward whitening."""

    value_clip: float = Field(0.2, gt=0, description="PPO: clip of the value update.")
    value_coef: float = Field(0.5, ge=0, description="PPO: weight of the value loss.")
    gamma: float = Field(1.0, gt=0, le=1, description="PPO: discount.")
    lam: float = Field(0.95, ge=0, le=1, description="PPO: GAE lambda.")
    kl_coef: float = Field(0.05, ge=0, description="PPO: KL coefficient (initial value when "
                           "adaptive).")
    kl_mode: Literal["reward", "loss"] = Field("reward", description="PPO: k1 KL in the reward, or "
                                               "k3 in the loss.")
    adaptive_kl: bool = Field(False, description="PPO: adapt the KL coefficient toward target_kl.")
    target_kl: float = Field(0.1, gt=0, description="PPO: KL per sequence the adaptive controller "
                             "aims for.")
    whiten_rewards: bool = Field(True, description="PPO: whiten scores across the batch before "
                                 "use.")


class GRPOSettings(_Strict):
    """GRPO's own settings (``[rl.grpo]``): the asymmetric clip, the KL weight,
    advantage scaling, the loss."""

    clip_eps_high: float = Field(0.28, gt=0, lt=1, description="GRPO: upper ratio clip "
                                 "(asymmetric).")
    beta: float = Field(0.04, ge=0, description="GRPO: coefficient of the k3 KL to the reference.")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="GRPO: advantage "
                                                             "scaling.")
    loss_type: Literal["grpo", "dr_grpo", "token_mean"] = Field("grpo", description="GRPO: loss "
                                                                "normalisation.")
    resample_zero_std: bool = Field(False, description="GRPO: resample groups whose rewards are "
                                    "all equal (once).")


RL_SECTIONS = {"ppo": PPOSettings, "grpo": GRPOSettings}
"""The algorithm sections of ``[rl]``; their keys are also accepted flat (``[rl] beta
= 0.1``, ``rl.beta``)."""


def _section_of(key: str) -> Optional[str]:
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


class RLSettings(_Strict):
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
    prompts_per_step: int = Field(4, ge=1, description="GRPO: prompts per iteration (PPO: times "
                                  "group_size).")
    group_size: int = Field(8, ge=2, description="GRPO: completions per prompt (PPO: one each, "
                            "more prompts).")
    max_new_tokens: int = Field(48, ge=1, description="Most tokens per completion.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (logprobs use the "
                               "same).")
    learning_rate: Optional[float] = Field(None, gt=0, lt=1, description="AdamW learning rate of "
                                           "LoRA (and value head); None: scaled to the model's "
                                           "size (slm_align/envelope/learning_rate.py).")
    epochs: int = Field(2, ge=1, description="Passes over each rollout.")
    minibatch_size: int = Field(8, ge=1, description="Sequences per optimizer step.")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="Ratio clip (PPO, and GRPO's lower "
                            "bound).")
    mask_truncated: bool = Field(False, description="Give truncated completions no gradient.")
    length_penalty: float = Field(0.0, ge=0, description="Soft penalty per token past 80% of "
                                  "max_new_tokens.")
    missing_eos_penalty: float = Field(0.0, ge=0, description="Subtract from the score of a "
                                                              "completion without EOS (TRL's "
                                                              "missing_eos_penalty; 0: off).")
    save_steps: int = Field(10, ge=1, description="Checkpoint every this many iterations (for "
                            "--resume).")
    eval_prompts: int = Field(64, ge=1, description="Held-out prompts scored before and after RL.")
    report_prompts: int = Field(200, ge=0, description="Held-out prompts of the evaluation report "
                                                       "`train` ends with (0: no report; "
                                                       "`slm-align evaluate` writes it later).")
    ppo: PPOSettings = Field(default_factory=PPOSettings, description="PPO's own settings.")
    grpo: GRPOSettings = Field(default_factory=GRPOSettings, description="GRPO's own settings.")
    lora: LoraSettings = Field(default_factory=lambda: LoraSettings(r=16, alpha=32.0, dropout=0.0),
                               description="The fresh RL adapter.")
    envelope: EnvelopeSettings = Field(default_factory=EnvelopeSettings, description="The safety "
                                       "envelope.")
    watchdog: WatchdogSettings = Field(default_factory=WatchdogSettings, description="The collapse "
                                       "watchdog.")

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
            flat = {key: data.pop(key) for key in list(data) if _section_of(key) == section}
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

    @field_validator("report_prompts")
    @classmethod
    def _report_needs_two(cls, value: int) -> int:
        if value == 1:
            raise ValueError("a report compares at least 2 prompts (0 skips it)")
        return value


class PreferenceSettings(_Strict):
    """DPO and KTO (``[preference]``): the policy optimised on preference files directly, from the
    merged SFT prior with a fresh LoRA; the reference is the prior (the adapter disabled). The
    envelope's rollback, gradient clip and merge-and-reinitialise come from ``[rl.envelope]``."""

    beta: float = Field(0.1, gt=0, description="Implicit reward scale: r = beta * (log pi - log "
                        "pi_ref) of a completion; larger keeps the policy closer to the prior.")
    steps: int = Field(60, ge=1, description="Optimizer steps.")
    batch_size: int = Field(8, ge=1, description="Pairs (DPO) or labelled completions (KTO) per "
                            "step.")
    learning_rate: Optional[float] = Field(None, gt=0, lt=1, description="AdamW learning rate of "
                                           "the fresh LoRA; None: scaled to the model's size as "
                                           "for RL.")
    desirable_weight: Optional[float] = Field(None, gt=0, description="KTO: weight of the "
                                              "desirable (thumbs-up) losses; None: n_undesirable / "
                                              "n_desirable, so both labels weigh the same in total "
                                              "(KTO paper, section 4.2).")
    undesirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the undesirable "
                                      "(thumbs-down) losses.")
    heldout_fraction: float = Field(0.2, gt=0, lt=0.9, description="Share of prompts kept out of "
                                    "training: held-out accuracy and the gate's perplexity are "
                                    "measured on them.")
    min_train: int = Field(16, ge=1, description="Gate: training pairs (DPO) or labelled "
                           "completions (KTO) needed.")
    min_heldout: int = Field(4, ge=1, description="Gate: held-out pairs needed to measure "
                             "preference accuracy.")
    min_label_share: float = Field(0.1, ge=0, lt=0.5, description="Gate (KTO): the rarer label's "
                                   "share of the training completions must reach this.")
    eval_every: int = Field(10, ge=1, description="Measure held-out accuracy every this many steps "
                            "(and at the end).")
    save_steps: int = Field(20, ge=1, description="Checkpoint every this many steps (for "
                            "--resume).")
    any_model: bool = Field(False, description="Train on feedback rows whose model_id is not an "
                            "artifact this run exported (recorded); off: refused in one line.")
    lora: LoraSettings = Field(default_factory=lambda: LoraSettings(r=16, alpha=32.0, dropout=0.0),
                               description="The fresh preference adapter.")


class HeadroomSettings(_Strict):
    max_ppl: float = Field(20.0, gt=1.0, description="Held-out perplexity the SFT prior must stay "
                           "below.")
    batch_size: int = Field(8, ge=1, description="Sequences per forward pass while measuring.")
    max_documents: int = Field(500, ge=1, description="Most eval documents scored.")
    min_reward_accuracy: float = Field(0.6, ge=0, le=1, description="Held-out pairwise accuracy "
                                       "the reward needs.")
    min_reward_std: float = Field(0.1, ge=0, description="Mean within-prompt std of rewards (over "
                                  "samples_per_prompt samples of each prompt) required: the "
                                  "variation both algorithms learn from.")
    spread_prompts: int = Field(16, ge=2, description="Held-out prompts sampled to measure the "
                                "reward spread.")
    samples_per_prompt: int = Field(4, ge=2, description="Completions sampled per prompt to "
                                    "measure the spread within a prompt (GRPO's group) and how "
                                    "many prompts get identical rewards.")
    max_all_equal_share: float = Field(0.5, ge=0, le=1, description="GRPO is advised only while at "
                                       "most this share of prompts get identical rewards in all "
                                       "their samples (GRPO learns nothing from those); above it "
                                       "PPO, whose learned value baseline copes.")
    max_new_tokens: int = Field(64, ge=1, description="Tokens sampled per completion when "
                                "measuring the spread.")


class TrackingSettings(_Strict):
    report_to: Literal["none", "tensorboard", "wandb", "mlflow", "trackio"] = Field(
        "none", description="Experiment tracker every training stage reports to, one run per stage "
        "with the recipe as its config: tensorboard (event files in OUT/tracking/<stage>/), wandb "
        "(offline unless WANDB_MODE is set), mlflow (a local file store unless MLFLOW_TRACKING_URI "
        "is set), trackio; none reports nothing.")


class Recipe(_Strict):
    seed: int = Field(0, description="Seeds the split, the initialisation and the data order.")
    model: ModelSettings = Field(default_factory=ModelSettings, description="Where the base model "
                                 "comes from.")
    compute: ComputeSettings = Field(default_factory=ComputeSettings, description="Device, "
                                     "precision, memory savers.")
    data: DataSettings = Field(default_factory=DataSettings, description="The corpus and its "
                               "split.")
    sft: SFTSettings = Field(default_factory=SFTSettings, description="Supervised fine-tuning.")
    reward: RewardSettings = Field(default_factory=RewardSettings, description="The Bradley-Terry "
                                   "reward model.")
    headroom: HeadroomSettings = Field(default_factory=HeadroomSettings, description="The headroom "
                                       "gate.")
    rl: RLSettings = Field(default_factory=RLSettings, description="PPO/GRPO inside the safety "
                           "envelope.")
    preference: PreferenceSettings = Field(default_factory=PreferenceSettings,
                                           description="DPO/KTO on preference files, inside the "
                                           "envelope.")
    tracking: TrackingSettings = Field(default_factory=TrackingSettings, description="Experiment "
                                       "tracking (reporting only: no stage's inputs, so it never "
                                       "makes a stage run again).")


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def _flat_rl_keys(tree: dict) -> set[str]:
    """The algorithm keys a recipe wrote flat under ``[rl]`` (``rl.beta``):
    errors name them as written."""
    rl = tree.get("rl")
    if not isinstance(rl, dict):
        return set()
    return {key for key in rl if _section_of(key) is not None}


def _describe(err: ValidationError, flat: set[str] = frozenset()) -> str:
    """One line naming the first invalid setting as the recipe wrote it, the
    reason and the value given."""
    first = err.errors()[0]
    loc = list(first["loc"])
    if loc[:1] == ["rl"] and len(loc) > 2 and loc[1] in RL_SECTIONS and loc[2] in flat:
        del loc[1]  # written flat (rl.beta), validated in its section (rl.grpo.beta)
    where = ".".join(str(p) for p in loc)
    if isinstance(first.get("input"), dict):  # a whole section (two spellings of one key): the message says it all
        return f"invalid setting {where}: {first['msg']}"
    return f"invalid setting {where}: {first['msg']} (got {first.get('input')!r})"


def load_recipe(path: Optional[Path] = None, overrides: Optional[dict[str, Any]] = None) -> Recipe:
    """Read a TOML recipe (optional) and apply ``{"sft.learning_rate": 1e-3, ...}``
    overrides (None skipped)."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {path} not found; pass an existing TOML file")
        try:
            tree = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"config file {path} is not valid TOML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, dotted, value)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as exc:
        raise UserError(_describe(exc, _flat_rl_keys(tree))) from None
