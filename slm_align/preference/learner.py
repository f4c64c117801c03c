"""DPO and KTO steps inside the envelope: fp32 sequence log-probabilities, the reference as the adapter disabled
(no second model copy), one guarded optimizer step per batch (NaN rollback), state for a bit-identical resume.

The reference never changes, so each answer's reference log-probability is computed once: the held-out answers
before the first step (the gate and the figures before training need them), each training answer when a batch
first uses it (kept in checkpoints). Later epochs run the policy only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

import torch

from slm_align.config import EnvelopeSettings, PreferenceSettings
from slm_align.data.encoding import IGNORE_INDEX, encode, pad_batch
from slm_align.data.examples import Example
from slm_align.data.pairs import Pair
from slm_align.envelope.run import TrainableRun
from slm_align.envelope.seeds import derive_seed
from slm_align.envelope.world import World
from slm_align.perplexity import labelled_logprobs
from slm_align.preference.data import PreferenceData
from slm_align.preference.losses import dpo_loss, implicit_rewards, kto_loss, kto_reference_point
from slm_align.stats import wilson_interval


@dataclass
class Completions:
    """Encoded (prompt, completion) rows and the reference's summed log-probability of each, shape (N,); NaN where
    not computed yet (training answers are scored on first use)."""

    rows: list[dict]
    ref: torch.Tensor

    def missing(self, indices: list[int]) -> list[int]:
        """The distinct ``indices`` whose reference is not computed yet, in order."""
        unknown = torch.isnan(self.ref[indices]).tolist()
        return list(dict.fromkeys(index for index, absent in zip(indices, unknown) if absent))


def encode_completion(prompt: str, completion: str, tokenizer, max_length: int) -> Optional[dict]:
    """Token ids and labels (prompt masked) of one completion; None when truncation leaves it no token."""
    row = encode(Example(prompt=prompt, completion=completion), tokenizer, max_length)
    if all(label == IGNORE_INDEX for label in row["labels"][1:]):
        return None
    return row


def sequence_logprobs(model, rows: list[dict], pad_id: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed fp32 log-probability of each row's completion, and its token count: two (N,) tensors."""
    sums = []
    counts = []
    for start in range(0, len(rows), batch_size):
        picked, mask = labelled_logprobs(model, pad_batch(rows[start:start + batch_size], pad_id))
        sums.append(picked.sum(-1))
        counts.append(mask.sum(-1))
    return torch.cat(sums), torch.cat(counts)


def _length(row: dict) -> int:
    return len(row["input_ids"])


def scored_by_length(model, rows: list[dict], pad_id: int, batch_size: int) -> torch.Tensor:
    """:func:`sequence_logprobs` of ``rows`` (no gradient needed) in batches of similar length, so that little of
    each batch is padding; returned in the order given, shape (N,)."""
    lengths = [_length(row) for row in rows]
    order = sorted(range(len(rows)), key=lengths.__getitem__)
    scored, _ = sequence_logprobs(model, [rows[index] for index in order], pad_id, batch_size)
    result = torch.empty_like(scored)
    result[torch.tensor(order, device=scored.device)] = scored
    return result


class PreferenceLearner(TrainableRun):
    """One DPO or KTO run's state: the shared trainable run (policy = merged prior + fresh LoRA, AdamW, the guard,
    the step; rl/trainable.py), the encoded answers and the reference's log-probabilities."""

    def __init__(self, policy, tokenizer, data: PreferenceData, settings: PreferenceSettings, algo: str,
                 envelope: EnvelopeSettings, seed: int, max_length: int, precision: str = "fp32",
                 checkpointing: bool = False):
        named_params = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        super().__init__(policy, named_params, settings.learning_rate, envelope, World(), precision, checkpointing)
        self.settings = settings
        self.algo = algo
        self.seed = seed
        self.pad_id = tokenizer.pad_token_id
        self.scoring_batch = 2 * settings.batch_size  # no-gradient passes: as many rows as a training step's forward
        encoder = _Encoder(tokenizer, max_length)
        self.train_items = encoder.train_items(data.train, algo)
        self._prepare_training(encoder)
        self.chosen, self.rejected = self._reference_pair(encoder.pairs(data.heldout_pairs))
        heldout_labelled = []  # DPO measures pairs only; KTO also the sign of each labelled answer's reward
        if algo == "kto":
            heldout_labelled = encoder.train_items(data.heldout_labelled, "kto")
        self.heldout_labels = [label for _, label in heldout_labelled]
        self.labelled = self._reference([row for row, _ in heldout_labelled])
        self.dropped = encoder.dropped
        self.desirable_weight = settings.desirable_weight
        if self.desirable_weight is None:
            self.desirable_weight = _balancing_weight(self.labels)

    # ---- the reference ---------------------------------------------------------------------------------------
    def _reference_of(self, rows: list[dict]) -> torch.Tensor:
        """The reference's log-probabilities of ``rows`` (the adapter disabled, no gradient), shape (N,)."""
        with torch.no_grad(), self.policy.disable_adapter(), self.forward_context():
            return scored_by_length(self.policy.eval(), rows, self.pad_id, self.scoring_batch)

    def _reference(self, rows: list[Optional[dict]], now: bool = True) -> Completions:
        """The rows (those that kept a token) with the reference's log-probabilities: computed ``now`` (held-out
        answers), or on first use (training answers: :meth:`_ensure_reference`)."""
        kept = [row for row in rows if row is not None]
        if not kept:
            return Completions([], torch.zeros(0, device=self.device))
        if now:
            return Completions(kept, self._reference_of(kept))
        return Completions(kept, torch.full((len(kept),), float("nan"), device=self.device))

    def _reference_pair(self, pairs: list[tuple[dict, dict]], now: bool = True) -> tuple[Completions, Completions]:
        return self._reference([c for c, _ in pairs], now), self._reference([r for _, r in pairs], now)

    def _ensure_reference(self, completions: Completions, indices: list[int]) -> None:
        """Score the batch's answers the reference has not scored yet (each training answer is scored once, and
        only if it is used: TRL's precomputation without its pass over answers a short run never reaches)."""
        missing = completions.missing(indices)
        if missing:
            completions.ref[missing] = self._reference_of([completions.rows[i] for i in missing])

    def _cached_references(self) -> dict[str, torch.Tensor]:
        """The training answers' reference log-probabilities computed so far (NaN: not yet), for checkpoints."""
        if self.algo == "dpo":
            return {"chosen": self.train_chosen.ref, "rejected": self.train_rejected.ref}
        return {"completions": self.train_completions.ref, "mismatched": self.mismatched.ref}

    def _prepare_training(self, encoder: "_Encoder") -> None:
        """Reference log-probabilities of the training completions (and, for KTO, of the mismatched pairs that
        estimate z_ref: item i's prompt with item i+1's completion)."""
        if self.algo == "dpo":
            self.train_chosen, self.train_rejected = self._reference_pair(self.train_items, now=False)
            self.labels = []
            return
        self.labels = [label for _, label in self.train_items]
        self.train_completions = self._reference([row for row, _ in self.train_items], now=False)
        texts = list(encoder.kept_texts)
        mismatched = [encoder.row(texts[i][0], texts[(i + 1) % len(texts)][1]) for i in range(len(texts))]
        self.mismatched = self._reference([row if row is not None else encoder.row(*texts[i])
                                           for i, row in enumerate(mismatched)], now=False)

    # ---- training --------------------------------------------------------------------------------------------
    def size(self) -> int:
        """Training items: pairs (DPO) or labelled completions (KTO)."""
        return len(self.train_items)

    def batch_indices(self, step: int) -> list[int]:
        """The items of ``step``: consecutive slots of per-epoch seeded shuffles (a resumed run draws the same)."""
        size = self.size()
        indices = []
        for slot in range(step * self.settings.batch_size, (step + 1) * self.settings.batch_size):
            epoch = slot // size
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "preference_order", 0, epoch=epoch))
            indices.append(int(torch.randperm(size, generator=generator)[slot % size]))
        return indices

    def loss(self, indices: list[int]) -> tuple[torch.Tensor, dict]:
        """The batch's DPO or KTO loss (with gradient) and its statistics."""
        if self.algo == "dpo":
            return self._dpo(indices)
        return self._kto(indices)

    def _dpo(self, indices: list[int]) -> tuple[torch.Tensor, dict]:
        self._ensure_reference(self.train_chosen, indices)
        self._ensure_reference(self.train_rejected, indices)
        rows = [self.train_chosen.rows[i] for i in indices] + [self.train_rejected.rows[i] for i in indices]
        logp, _ = sequence_logprobs(self.policy, rows, self.pad_id, len(rows))
        chosen = logp[: len(indices)]
        rejected = logp[len(indices):]
        terms = dpo_loss(chosen, rejected, self.train_chosen.ref[indices], self.train_rejected.ref[indices],
                         self.settings.beta)
        margins = terms.rewards.detach()
        return terms.loss, {"accuracy": float((margins > 0).float().mean()), "margin": float(margins.mean()),
                            "logp/chosen": float(chosen.detach().mean()),
                            "logp/rejected": float(rejected.detach().mean())}

    def _kto(self, indices: list[int]) -> tuple[torch.Tensor, dict]:
        self._ensure_reference(self.train_completions, indices)
        self._ensure_reference(self.mismatched, indices)
        rows = [self.train_completions.rows[i] for i in indices]
        logp, _ = sequence_logprobs(self.policy, rows, self.pad_id, len(rows))
        with torch.no_grad():
            kl_rows = [self.mismatched.rows[i] for i in indices]
            kl_logp, _ = sequence_logprobs(self.policy, kl_rows, self.pad_id, len(kl_rows))
        z_ref = kto_reference_point(kl_logp, self.mismatched.ref[indices])
        desirable = torch.tensor([self.labels[i] for i in indices], device=self.device)
        terms = kto_loss(logp, self.train_completions.ref[indices], desirable, z_ref, self.settings.beta,
                         self.desirable_weight, self.settings.undesirable_weight)
        rewards = terms.rewards.detach()
        stats = {"kl": float(z_ref)}
        if bool(desirable.any()):
            stats["reward/desirable"] = float(rewards[desirable].mean())
        if bool((~desirable).any()):
            stats["reward/undesirable"] = float(rewards[~desirable].mean())
        return terms.loss, stats

    def train_step(self) -> dict:
        """One guarded step on the next batch; its statistics (``rolled_back`` when the envelope undid it)."""
        indices = self.batch_indices(self.step)
        snapshot = self.guard.snapshot()
        self.prepare_forward()
        with self.forward_context():
            loss, stats = self.loss(indices)
        result = self.guard.step(loss, snapshot, self.after_backward)
        self.step += 1
        return dict(stats, **result, step=self.step, **{"guard/rollbacks": self.counters.rollbacks})

    # ---- held-out figures -------------------------------------------------------------------------------------
    def heldout(self) -> dict:
        """Held-out preference figures of the current policy (see :func:`heldout_figures`)."""
        with torch.no_grad(), self.forward_context():
            self.policy.eval()
            chosen = self._policy_logprobs(self.chosen)
            rejected = self._policy_logprobs(self.rejected)
            labelled = self._policy_logprobs(self.labelled)
        return heldout_figures(chosen, rejected, self.chosen.ref, self.rejected.ref, labelled, self.labelled.ref,
                               self.heldout_labels, self.settings.beta)

    def _policy_logprobs(self, completions: Completions) -> torch.Tensor:
        if not completions.rows:
            return torch.zeros(0, device=self.device)
        return scored_by_length(self.policy, completions.rows, self.pad_id, self.scoring_batch)

    def prior_perplexity(self) -> Optional[float]:
        """Perplexity of the reference (the SFT prior) on the held-out chosen completions: exp(-sum logp / tokens)."""
        if not self.chosen.rows:
            return None
        tokens = sum(sum(label != IGNORE_INDEX for label in row["labels"][1:]) for row in self.chosen.rows)
        return float(torch.exp(-self.chosen.ref.double().sum() / tokens))

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit for bit."""
        references = {name: ref.clone() for name, ref in self._cached_references().items()}
        return dict(self.run_state(), references=references)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`."""
        self.load_run_state(state)
        for name, ref in self._cached_references().items():
            ref.copy_(state["references"][name])


def heldout_figures(chosen, rejected, chosen_ref, rejected_ref, labelled, labelled_ref, labels: list[bool],
                    beta: float) -> dict:
    """Held-out figures; tensors (P,) for P pairs and (L,) for L labelled completions.

    pair accuracy: share of pairs with implicit-reward margin r_c - r_r > 0 (TRL's rewards/accuracies), with a 95%
    Wilson interval; margin: its mean; logp accuracy: share with log pi(chosen) > log pi(rejected) (what a sampler
    of the policy prefers); label accuracy (KTO): share of labelled completions whose implicit reward has the
    label's sign; kl: mean log-ratio log pi - log pi_ref over the held-out completions (a KL estimate, exact only for
    completions sampled from the policy).
    """
    figures: dict = {}
    if len(chosen):
        margins = implicit_rewards(chosen, chosen_ref, beta) - implicit_rewards(rejected, rejected_ref, beta)
        wins = int((margins > 0).sum())
        figures.update(pair_accuracy=wins / len(margins), pair_accuracy_ci=wilson_interval(wins, len(margins)),
                       margin=float(margins.mean()), pairs=len(margins),
                       logp_accuracy=float((chosen > rejected).float().mean()),
                       prior_logp_accuracy=float((chosen_ref > rejected_ref).float().mean()),
                       **{"logp/chosen": float(chosen.mean()), "logp/rejected": float(rejected.mean())})
    if len(labelled):
        rewards = implicit_rewards(labelled, labelled_ref, beta)
        right = sum(bool(r > 0) if label else bool(r < 0) for r, label in zip(rewards, labels))
        figures.update(label_accuracy=right / len(labels), label_accuracy_ci=wilson_interval(right, len(labels)))
    ratios = [float(x) for x in (chosen - chosen_ref)] + [float(x) for x in (rejected - rejected_ref)]
    if ratios:
        figures["kl"] = statistics.fmean(ratios)
    return figures


def _balancing_weight(labels: list[bool]) -> float:
    """KTO's default desirable weight n_undesirable / n_desirable (1 when either side is missing)."""
    good = sum(labels)
    bad = len(labels) - good
    if good == 0 or bad == 0:
        return 1.0
    return bad / good


class _Encoder:
    """Encodes training and held-out completions, counting those truncation leaves without a token."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.dropped = 0
        self.kept_texts: list[tuple[str, str]] = []

    def row(self, prompt: str, completion: str) -> Optional[dict]:
        return encode_completion(prompt, completion, self.tokenizer, self.max_length)

    def pairs(self, pairs: list[Pair]) -> list[tuple[dict, dict]]:
        """Encoded (chosen, rejected) of the pairs whose both sides keep a token."""
        encoded = []
        for pair in pairs:
            chosen = self.row(pair.prompt, pair.chosen)
            rejected = self.row(pair.prompt, pair.rejected)
            if chosen is None or rejected is None:
                self.dropped += 1
                continue
            encoded.append((chosen, rejected))
        return encoded

    def train_items(self, items: list, algo: str) -> list[tuple]:
        """DPO: (chosen row, rejected row) per pair; KTO: (row, label) per labelled completion."""
        if algo == "dpo":
            return self.pairs(items)
        encoded = []
        for item in items:
            row = self.row(item.prompt, item.completion)
            if row is None:
                self.dropped += 1
                continue
            encoded.append((row, item.label))
            self.kept_texts.append((item.prompt, item.completion))
        return encoded
