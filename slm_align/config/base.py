"""The settings of the data, the model, compute, LoRA and the Trainer stages (SFT, the reward
model), each field with its bounds and a description (the CLI's help comes from it)."""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Strict(BaseModel):
    """A settings section: unknown keys and bad values are refused, on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSettings(Strict):
    source: Optional[str] = Field(None, description="HF directory, hub id or .gguf file; "
                                                    "None = the bundled model.")
    trust_remote_code: bool = Field(False, description="Run code shipped with a hub "
                                                       "model (off unless asked).")
    allow_pickle: bool = Field(False, description="Accept pickle (.bin) checkpoints "
                                                  "(unsafe; off unless asked).")


class ComputeSettings(Strict):
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
                                         "pass (SFT, reward, RL, DPO/KTO): less memory, "
                                         "about a third more compute.")
    load_in_4bit: bool = Field(False, description="QLoRA: NF4 4-bit base weights (bitsandbytes) "
                               "for SFT; CUDA only (refused elsewhere and by the other stages).")
    threads: Optional[int] = Field(None, ge=1, description="CPU threads of PyTorch and llama.cpp "
                                   "(n_threads, n_threads_batch). Default: a device profile's "
                                   "where a runtime command names one; else OMP_NUM_THREADS when "
                                   "set; else the cores this process may use less the 1-minute "
                                   "load average, at least 1, at most 16.")
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


class DataSettings(Strict):
    path: Optional[str] = Field(None, description="Corpus file, datasets directory or hub dataset "
                                "id; demo: the generated demo stories (./demo for a file of that "
                                "name). sft, check-headroom and train refuse to run without it "
                                "unless the data comes from a finished SFT stage.")
    tasks: Optional[str] = Field(None, description="Task file for RL, the gate's reward spread and "
                                 "evaluation: a prompt column (text or chat messages) and any "
                                 "others (answer, tools, ...), which reach the reward functions as "
                                 "keyword lists; jsonl, json, parquet or a datasets directory. "
                                 "None: prompts are the openings of the "
                                 "corpus's held-out documents.")
    text_field: Optional[str] = Field(None, description="Column holding the text; found "
                                      "automatically when None.")
    demo_documents: int = Field(2000, ge=10, description="How many demo stories to "
                                                         "generate (data.path demo).")
    eval_fraction: float = Field(0.1, gt=0.0, lt=0.5,
                                 description="Share of documents kept for evaluation.")
    heldout_prompts: int = Field(200, ge=1,
                                 description="Most documents kept back as held-out prompts.")
    max_length: int = Field(256, ge=8, le=32768, description="Tokens per training sequence "
                                                             "(longer is truncated).")

    @property
    def uses_demo(self) -> bool:
        """Whether the corpus is the demo stories: named (``demo``) or left unset by a
        caller of the library."""
        return self.path is None or self.path == DEMO


class LoraSettings(Strict):
    r: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: Optional[list[str]] = Field(None, description="Modules to adapt; None "
                                                                  "= per architecture.")


class TrainSettings(Strict):
    """Optimizer and schedule settings shared by the stages that run on transformers' Trainer."""

    epochs: float = Field(1.0, gt=0, description="Passes over the training data.")
    max_steps: int = Field(-1, ge=-1, description="Stop after this many optimizer "
                                                  "steps (-1: use epochs).")
    learning_rate: float = Field(2e-3, gt=0, lt=1,
                                 description="Peak learning rate of the cosine schedule.")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="Share of steps spent warming up.")
    batch_size: int = Field(8, ge=1, description="Sequences (SFT) or pairs "
                                                 "(reward) per device batch.")
    grad_accum: int = Field(1, ge=1, description="Batches accumulated per optimizer step.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    save_steps: int = Field(50, ge=1, description="Checkpoint every this "
                                                  "many steps (for --resume).")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="The adapter.")


class SFTSettings(TrainSettings):
    neftune_alpha: Optional[float] = Field(5.0, ge=0, description="NEFTune noise scale; "
                                                                  "None or 0 disables it.")


class PairSettings(Strict):
    mix: dict[str, float] = Field(default_factory=lambda: {"truncate": 1.0, "shuffle": 1.0,
                                                           "mismatch": 1.0, "dropout": 1.0},
                                  description="Relative weight of each corruption that "
                                              "makes a rejected text.")
    opening_sentences: int = Field(2, ge=1,
                                   description="Sentences of a document that form the prompt.")
    min_words: int = Field(3, ge=1, description="Pairs whose chosen or rejected side has "
                                                "fewer words are dropped.")
    dropout_rate: float = Field(0.3, gt=0, lt=1, description="Share of words removed by "
                                                             "the dropout corruption.")
    synthetic: bool = Field(True, description="Build pairs from the corpus (besides any "
                                              "imported preferences).")


class RewardSettings(TrainSettings):
    learning_rate: float = Field(1e-3, gt=0, lt=1,
                                 description="Peak learning rate of the cosine schedule.")
    margin: float = Field(0.0, ge=0, description="Bradley-Terry margin: chosen must beat "
                                                 "rejected by this much.")
    center_coefficient: float = Field(0.01, ge=0, description="Weight of the (r_chosen + "
                                      "r_rejected)^2 penalty.")
    pairs: PairSettings = Field(default_factory=PairSettings,
                                description="Synthetic preference pairs.")
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


class PreferenceSettings(Strict):
    """DPO and KTO (``[preference]``): the policy optimised on preference files directly, from the
    merged SFT prior with a fresh LoRA; the reference is the prior (the adapter disabled). The
    envelope's rollback, gradient clip and merge-and-reinitialise come from ``[rl.envelope]``."""

    beta: float = Field(0.1, gt=0, description="Implicit reward scale: r = beta * (log pi - log "
                        "pi_ref) of a completion; larger keeps the policy closer to the prior.")
    steps: int = Field(60, ge=1, description="Optimizer steps.")
    batch_size: int = Field(8, ge=1, description="Pairs (DPO) or labelled "
                                                 "completions (KTO) per step.")
    learning_rate: Optional[float] = Field(None, gt=0, lt=1, description="AdamW learning rate of "
                                           "the fresh LoRA; None: scaled to the "
                                           "model's size as for RL.")
    desirable_weight: Optional[float] = Field(
        None, gt=0,
        description="KTO: weight of the desirable (thumbs-up) losses; None: undesirable_weight x "
                    "n_undesirable / n_desirable, so both labels weigh the same in total (KTO "
                    "paper).")
    undesirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the undesirable "
                                      "(thumbs-down) losses.")
    heldout_fraction: float = Field(0.2, gt=0, lt=0.9, description="Share of prompts kept out of "
                                    "training: held-out accuracy and the gate's "
                                    "perplexity are measured on them.")
    min_train: int = Field(16, ge=1, description="Gate: training pairs (DPO) or labelled "
                           "completions (KTO) needed.")
    min_heldout: int = Field(4, ge=1, description="Gate: held-out pairs needed to measure "
                             "preference accuracy.")
    min_label_share: float = Field(0.1, ge=0, lt=0.5, description="Gate (KTO): the rarer label's "
                                   "share of the training completions must reach this.")
    eval_every: int = Field(10, ge=1, description="Measure held-out accuracy every this many "
                                                  "steps (and at the end).")
    save_steps: int = Field(20, ge=1, description="Checkpoint every this "
                                                  "many steps (for --resume).")
    any_model: bool = Field(False, description="Train on feedback rows whose model_id is not an "
                            "artifact this run exported (recorded); off: refused in one line.")
    lora: LoraSettings = Field(default_factory=lambda: LoraSettings(r=16, alpha=32.0, dropout=0.0),
                               description="The fresh preference adapter.")


class HeadroomSettings(Strict):
    max_ppl: float = Field(20.0, gt=1.0, description="Held-out perplexity the SFT "
                                                     "prior must stay below.")
    batch_size: int = Field(8, ge=1, description="Sequences per forward pass while measuring.")
    max_documents: int = Field(500, ge=1, description="Most eval documents scored.")
    min_reward_accuracy: float = Field(0.6, ge=0, le=1, description="Held-out pairwise accuracy "
                                                                    "the reward needs.")
    min_reward_std: float = Field(0.1, ge=0, description="Mean within-prompt std of rewards (over "
                                  "samples_per_prompt samples of each prompt) required: the "
                                  "variation both algorithms learn from.")
    spread_prompts: int = Field(16, ge=2, description="Held-out prompts sampled to "
                                                      "measure the reward spread.")
    samples_per_prompt: int = Field(4, ge=2, description="Completions sampled per prompt to "
                                    "measure the spread within a prompt (GRPO's group) and how "
                                    "many prompts get identical rewards.")
    max_all_equal_share: float = Field(0.5, ge=0, le=1, description="GRPO is advised only while at "
                                       "most this share of prompts get identical rewards in all "
                                       "their samples (GRPO learns nothing from those); above it "
                                       "PPO, whose learned value baseline copes.")
    max_new_tokens: int = Field(64, ge=1, description="Tokens sampled per completion when "
                                "measuring the spread.")
    temperature: Optional[float] = Field(None, gt=0, description="Sampling temperature of the "
                                         "spread's samples; None: RL's (rl.temperature), the "
                                         "temperature whose spread GRPO's groups see.")


class TrackingSettings(Strict):
    report_to: Literal["none", "tensorboard", "wandb", "mlflow", "trackio"] = Field(
        "none", description="Experiment tracker every training stage reports to, one run per stage "
        "with the recipe as its config: tensorboard (event files in OUT/tracking/<stage>/), wandb "
        "(offline unless WANDB_MODE is set), mlflow (a local file store unless MLFLOW_TRACKING_URI "
        "is set), trackio; none reports nothing.")
