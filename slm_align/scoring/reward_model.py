"""The Bradley-Terry reward model: a one-output sequence classifier initialised from the SFT policy.

The backbone starts as base + SFT adapter (merged); a fresh LoRA adapter and the score head train
in fp32 with loss ``-log sigmoid(r_chosen - r_rejected - margin) + c * (r_chosen +
r_rejected)^2``. The reward of a text is the score head applied to the hidden state of its last
real token (EOS appended to a finished text, never to a truncated completion: that one is scored
as written), with right padding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from slm_align.data.encoding import encode, pad_batch
from slm_align.data.examples import Example
from slm_align.errors import UserError
from slm_align.modeling.accelerator import device_of
from slm_align.modeling.models import ensure_pad_token
from slm_align.progress import counted
from slm_align.stats import win_score


def encode_scored(tokenizer, prompt: str, completion: str, max_length: int,
                  ended: bool = True) -> list[int]:
    """Token ids of ``prompt + completion`` + EOS: the one format for reward
    training, RL and evaluation.

    ``ended=False`` (a completion cut at the token budget) leaves the EOS off: the reward model sees
    the text as written, not as if the policy had finished it.
    """
    ids = encode(Example(prompt=prompt, completion=completion), tokenizer, max_length)["input_ids"]
    if not ended and len(ids) > 1 and ids[-1] == tokenizer.eos_token_id:
        return ids[:-1]
    return ids


def classifier_from_policy(policy, pad_token_id: int):
    """A one-output sequence classifier whose backbone holds the (merged) policy's weights.

    The backbone takes the policy's tensors themselves (no copy: built without weights,
    then assigned), and only the score head is initialised, so the reward stage never
    holds two copies of the model; the policy's output projection is freed with the policy
    unless tied to the embeddings.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForSequenceClassification

    config = policy.config.__class__.from_dict(policy.config.to_dict())
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    with init_empty_weights(include_buffers=False):
        classifier = AutoModelForSequenceClassification.from_config(config)
    missing, _ = classifier.load_state_dict(policy.state_dict(), strict=False, assign=True)
    if any(not key.startswith("score.") for key in missing):
        raise UserError("cannot build a reward model from this policy: backbone weights "
                        f"missing ({missing[:3]})")
    device = next(policy.parameters()).device
    classifier.score.to_empty(device=device)
    with torch.no_grad():
        classifier._init_weights(classifier.score)
    return classifier.float().eval()


def _unwrap(model):
    """The classifier inside a DDP wrapper (data-parallel Trainer) and a peft
    model, whichever are there."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def sequence_rewards(model, input_ids, attention_mask):
    """One float32 reward per right-padded sequence: the score head at its last attended token.

    The model's own forward runs (through the DDP wrapper when the Trainer trains data parallel:
    only a forward through it averages the gradients across ranks); its last hidden states are
    pooled here, at the last attended token, because the classifier's own pooling looks for the last
    non-pad id, which misses a final EOS when the pad token is EOS."""
    import torch

    hidden = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states[-1]
    classifier = _unwrap(model)
    last = attention_mask.sum(-1) - 1
    pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return classifier.score(pooled).squeeze(-1).float()


def bradley_terry_loss(chosen, rejected, margin: float = 0.0, center_coefficient: float = 0.0):
    import torch.nn.functional as F

    loss = -F.logsigmoid(chosen - rejected - margin).mean()
    if center_coefficient:
        loss = loss + center_coefficient * ((chosen + rejected) ** 2).mean()
    return loss


def collate_pairs(rows: list[dict], pad_id: int) -> dict:
    """Chosen sequences first, then rejected, in one right-padded batch."""
    flat = [{"input_ids": r["chosen_ids"], "labels": r["chosen_ids"]} for r in rows]
    flat += [{"input_ids": r["rejected_ids"], "labels": r["rejected_ids"]} for r in rows]
    batch = pad_batch(flat, pad_id)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def score_texts(model, tokenizer, prompts: list[str], completions: list[str], max_length: int = 256,
                batch_size: int = 16, truncated: Optional[list[bool]] = None,
                what: str = "reward model") -> list[float]:
    """Rewards of ``prompt + completion`` texts, in batches, without gradients; ``truncated`` ones
    get no EOS. ``what`` names the texts counted in the running stage's progress
    (:func:`slm_align.progress.counted`)."""
    import torch

    device = device_of(model)
    ended = [not t for t in truncated] if truncated is not None else [True] * len(prompts)
    scores: list[float] = []
    with torch.no_grad(), counted(what, len(prompts), "texts") as count:
        for start in range(0, len(prompts), batch_size):
            end = start + batch_size
            rows = [{"input_ids": ids, "labels": ids} for ids in (
                encode_scored(tokenizer, p, c, max_length, e)
                for p, c, e in zip(prompts[start:end], completions[start:end], ended[start:end]))]
            batch = pad_batch(rows, tokenizer.pad_token_id)
            scores += sequence_rewards(model, batch["input_ids"].to(device),
                                       batch["attention_mask"].to(device)).tolist()
            count.advance(len(rows))
    return scores


def load_reward_model(path: Path, trust_remote_code: bool = False):
    """A saved reward model (merged classifier + tokenizer), alone: ``(model, tokenizer)``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"reward model {path} not found (no config.json); pass the "
                        "reward/model directory of a run")
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype="float32", use_safetensors=True,
                                                                   trust_remote_code=trust_remote_code)
        tokenizer = ensure_pad_token(AutoTokenizer.from_pretrained(path))
    except Exception as exc:
        raise UserError(f"reward model {path} cannot be loaded "
                        f"({type(exc).__name__}); it may be corrupt") from None
    if model.config.num_labels != 1:
        raise UserError(f"reward model {path} has {model.config.num_labels} outputs; "
                        "a reward model has one")
    return model.float().eval(), tokenizer


def pairwise_metrics(model, tokenizer, pairs, max_length: int, batch_size: int = 16) -> dict:
    """Held-out pairwise accuracy (ties count half), mean margin, and reward
    statistics, overall and per kind."""
    import statistics

    prompts = [p.prompt for p in pairs]
    chosen = score_texts(model, tokenizer, prompts, [p.chosen for p in pairs], max_length,
                         batch_size, what="reward accuracy, chosen")
    rejected = score_texts(model, tokenizer, prompts, [p.rejected for p in pairs], max_length,
                           batch_size, what="reward accuracy, rejected")
    wins = [win_score(c, r) for c, r in zip(chosen, rejected)]
    by_kind: dict[str, list[float]] = {}
    for pair, win in zip(pairs, wins):
        by_kind.setdefault(pair.kind, []).append(win)
    every = chosen + rejected
    return {"accuracy": sum(wins) / len(wins), "pairs": len(pairs),
            "mean_margin": sum(c - r for c, r in zip(chosen, rejected)) / len(pairs),
            "accuracy_by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
            "reward_mean": statistics.fmean(every), "reward_std": statistics.pstdev(every),
            "chosen_mean": statistics.fmean(chosen), "rejected_mean": statistics.fmean(rejected)}
