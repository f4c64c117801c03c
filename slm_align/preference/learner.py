"""What DPO (preference/dpo.py) and KTO (preference/kto.py) share, inside the envelope: fp32
sequence log-probabilities, the reference as the adapter disabled (no second model copy), the
encoded answers, the batch order, the held-out figures and the checkpoint.

The reference never changes, so each answer's reference log-probability is computed once: the
held-out answers before the first step (the gate and the figures before training need them), each
training answer when a batch first uses it (kept in checkpoints). Later epochs run the policy only.
Each algorithm is its own class with its own ``train_step``; nothing here calls an algorithm back.
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
from slm_align.data.preferences import Labelled
from slm_align.envelope.gate import Figure
from slm_align.envelope.run import Placement, TrainableRun
from slm_align.envelope.seeds import derive_seed
from slm_align.preference.data import PreferenceData
from slm_align.preference.losses import implicit_rewards
from slm_align.scoring.perplexity import labelled_logprobs
from slm_align.stats import wilson_interval


@dataclass
class Completions:
    """Encoded (prompt, completion) rows and the reference's summed log-probability of each, (N,);
    NaN where not computed yet (training answers are scored on first use)."""

    rows: list[dict]
    ref: torch.Tensor

    def missing(self, indices: list[int]) -> list[int]:
        """The distinct ``indices`` whose reference is not computed yet, in order."""
        unknown = torch.isnan(self.ref[indices]).tolist()
        return list(dict.fromkeys(index for index, absent in zip(indices, unknown) if absent))


def encode_completion(prompt: str, completion: str, tokenizer, max_length: int) -> Optional[dict]:
    """Token ids and labels (prompt masked) of one completion; None when truncation leaves it no
    token."""
    row = encode(Example(prompt=prompt, completion=completion), tokenizer, max_length)
    if all(label == IGNORE_INDEX for label in row["labels"][1:]):
        return None
    return row


def sequence_logprobs(model, rows: list[dict], pad_id: int,
                      batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed fp32 log-probability of each row's completion, and its token count: two (N,)."""
    sums = []
    counts = []
    for start in range(0, len(rows), batch_size):
        picked, mask = labelled_logprobs(model, pad_batch(rows[start:start + batch_size], pad_id))
        sums.append(picked.sum(-1))
        counts.append(mask.sum(-1))
    return torch.cat(sums), torch.cat(counts)


def scored_by_length(model, rows: list[dict], pad_id: int, batch_size: int) -> torch.Tensor:
    """:func:`sequence_logprobs` of ``rows`` (no gradient needed) in batches of similar length, so
    that little of each batch is padding; returned in the order given, (N,)."""
    lengths = [len(row["input_ids"]) for row in rows]
    order = sorted(range(len(rows)), key=lengths.__getitem__)
    scored, _ = sequence_logprobs(model, [rows[index] for index in order], pad_id, batch_size)
    result = torch.empty_like(scored)
    result[torch.tensor(order, device=scored.device)] = scored
    return result


class Encoder:
    """Encodes training and held-out completions, counting those truncation leaves no token."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.dropped = 0

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

    def labelled(self, items: list[Labelled]) -> list[tuple[dict, Labelled]]:
        """(encoded row, item) of each labelled completion that keeps a token."""
        encoded = []
        for item in items:
            row = self.row(item.prompt, item.completion)
            if row is None:
                self.dropped += 1
                continue
            encoded.append((row, item))
        return encoded


class PreferenceLearner(TrainableRun):
    """What a DPO or KTO run holds besides its algorithm: the envelope's trainable run (policy =
    merged prior + fresh LoRA, AdamW, the guard, the step; envelope/run.py), the encoder, the
    reference's log-probabilities, the held-out answers. Subclasses (:class:`~.dpo.DPO`,
    :class:`~.kto.KTO`) own ``train_step``, and ``prepare`` their data: encode the training items,
    name the answers whose reference scores a checkpoint keeps (:attr:`answers`), and keep the
    held-out answers they measure (:meth:`keep_heldout`)."""

    algo = ""
    """"dpo" or "kto" (the stage's name for the run)."""

    unit = ""
    """What it trains on, as the gate counts it ("pairs", "labelled completions")."""

    def __init__(self, policy, tokenizer, data: PreferenceData, settings: PreferenceSettings,
                 envelope: EnvelopeSettings, seed: int, max_length: int,
                 placement: Placement = Placement()):
        """``placement``: one process always (DPO and KTO refuse a data-parallel launch)."""
        named_params = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        super().__init__(policy, named_params, settings.learning_rate, envelope, placement)
        self.settings = settings
        self.seed = seed
        self.pad_id = tokenizer.pad_token_id
        self.scoring_batch = 2 * settings.batch_size  # no-gradient passes: a training step's rows
        self.encoder = Encoder(tokenizer, max_length)
        self.train_items: list[tuple] = []
        """Pairs (DPO) or labelled completions (KTO), encoded."""
        self.answers: dict[str, Completions] = {}
        """The training answers by name, whose reference scores so far a checkpoint keeps."""
        self.desirable_weight = settings.desirable_weight
        """KTO's lambda_D (None in the settings: balanced by KTO's ``prepare``; 1 under DPO)."""
        self.prepare(data)

    def prepare(self, data: PreferenceData) -> None:
        """The algorithm's training items and held-out answers (each subclass has its own)."""
        raise NotImplementedError

    def heldout_count(self) -> tuple[str, int]:
        """The held-out answers the algorithm is measured on, as the gate names them, and how
        many there are."""
        return "held-out pairs", len(self.chosen.rows)

    def balance_figures(self, data: PreferenceData, settings: PreferenceSettings) -> list[Figure]:
        """The gate's figures on the balance of the training data (none: a pair is balanced by
        construction)."""
        return []

    def own_figures(self) -> dict:
        """What the manifest records of the algorithm's own settings (KTO: its desirable weight;
        the key is kept, None, for the others)."""
        return {"desirable_weight": None}

    # ---- the reference -----------------------------------------------------------------------
    def reference_of(self, rows: list[dict]) -> torch.Tensor:
        """The reference's log-probabilities of ``rows`` (adapter disabled, no gradient), (N,)."""
        with torch.no_grad(), self.policy.disable_adapter(), self.forward_context():
            return scored_by_length(self.policy.eval(), rows, self.pad_id, self.scoring_batch)

    def reference(self, rows: list[Optional[dict]], now: bool = True) -> Completions:
        """The rows (those that kept a token) with the reference's log-probabilities: computed
        ``now`` (held-out answers), or on first use (training answers: :meth:`ensure_reference`)."""
        kept = [row for row in rows if row is not None]
        if not kept:
            return Completions([], torch.zeros(0, device=self.device))
        if now:
            return Completions(kept, self.reference_of(kept))
        return Completions(kept, torch.full((len(kept),), float("nan"), device=self.device))

    def reference_pair(self, pairs: list[tuple[dict, dict]],
                       now: bool = True) -> tuple[Completions, Completions]:
        """:meth:`reference` of the chosen and of the rejected answers of ``pairs``."""
        chosen = self.reference([c for c, _ in pairs], now)
        return chosen, self.reference([r for _, r in pairs], now)

    def ensure_reference(self, indices: list[int], *answers: Completions) -> None:
        """Score the batch's ``answers`` the reference has not scored yet: each training answer
        once, and only if a batch uses it (TRL's precomputation without its pass over answers a
        short run never reaches)."""
        for completions in answers:
            missing = completions.missing(indices)
            if missing:
                completions.ref[missing] = self.reference_of([completions.rows[i] for i in missing])

    def keep_heldout(self, pairs: list[Pair], labelled: list[Labelled]) -> None:
        """Encode the held-out pairs and labelled completions and score them under the reference
        now; :attr:`dropped` counts every answer truncation left no token, training ones too."""
        self.chosen, self.rejected = self.reference_pair(self.encoder.pairs(pairs))
        encoded = self.encoder.labelled(labelled)
        self.heldout_labels = [item.label for _, item in encoded]
        self.labelled = self.reference([row for row, _ in encoded])
        self.dropped = self.encoder.dropped

    # ---- training ----------------------------------------------------------------------------
    def size(self) -> int:
        """Training items: pairs (DPO) or labelled completions (KTO)."""
        return len(self.train_items)

    def batch_indices(self, step: int) -> list[int]:
        """The items of ``step``: consecutive slots of per-epoch seeded shuffles (a resumed run
        draws the same)."""
        size = self.size()
        indices = []
        for slot in range(step * self.settings.batch_size, (step + 1) * self.settings.batch_size):
            epoch = slot // size
            seed = derive_seed(self.seed, "preference_order", 0, epoch=epoch)
            generator = torch.Generator().manual_seed(seed)
            indices.append(int(torch.randperm(size, generator=generator)[slot % size]))
        return indices

    def finish_step(self, stats: dict, result: dict) -> dict:
        """Count the step; its statistics with the guarded step's ``result`` (``loss`` and
        ``grad_norm``, or ``rolled_back``) and the run's rollbacks so far."""
        self.step += 1
        return dict(stats, **result, step=self.step, **{"guard/rollbacks": self.counters.rollbacks})

    # ---- held-out figures --------------------------------------------------------------------
    def heldout(self) -> dict:
        """Held-out preference figures of the current policy (see :func:`heldout_figures`)."""
        with torch.no_grad(), self.forward_context():
            self.policy.eval()
            chosen = self._policy_logprobs(self.chosen)
            rejected = self._policy_logprobs(self.rejected)
            labelled = self._policy_logprobs(self.labelled)
        return heldout_figures(chosen, rejected, self.chosen.ref, self.rejected.ref, labelled,
                               self.labelled.ref, self.heldout_labels, self.settings.beta)

    def _policy_logprobs(self, completions: Completions) -> torch.Tensor:
        if not completions.rows:
            return torch.zeros(0, device=self.device)
        return scored_by_length(self.policy, completions.rows, self.pad_id, self.scoring_batch)

    def prior_perplexity(self) -> Optional[float]:
        """Perplexity of the reference (the SFT prior) on the held-out chosen completions:
        exp(-sum logp / tokens)."""
        if not self.chosen.rows:
            return None
        tokens = sum(sum(label != IGNORE_INDEX for label in row["labels"][1:])
                     for row in self.chosen.rows)
        return float(torch.exp(-self.chosen.ref.double().sum() / tokens))

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit for bit (the reference scores so far)."""
        references = {name: answers.ref.clone() for name, answers in self.answers.items()}
        return dict(self.run_state(), references=references)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`."""
        self.load_run_state(state)
        for name, answers in self.answers.items():
            answers.ref.copy_(state["references"][name])


def heldout_figures(chosen, rejected, chosen_ref, rejected_ref, labelled, labelled_ref,
                    labels: list[bool], beta: float) -> dict:
    """Held-out figures; tensors (P,) for P pairs and (L,) for L labelled completions.

    pair accuracy: share of pairs with implicit-reward margin r_c - r_r > 0 (TRL's
    rewards/accuracies), with a 95% Wilson interval; margin: its mean; logp accuracy: share with
    log pi(chosen) > log pi(rejected) (what a sampler of the policy prefers); label accuracy (KTO):
    share of labelled completions whose implicit reward has the label's sign; kl: mean log-ratio
    log pi - log pi_ref over the held-out pairs' answers (a KL estimate, exact only for completions
    sampled from the policy).
    """
    figures: dict = {}
    if len(chosen):
        margins = (implicit_rewards(chosen, chosen_ref, beta)
                   - implicit_rewards(rejected, rejected_ref, beta))
        wins = int((margins > 0).sum())
        figures.update(pair_accuracy=wins / len(margins),
                       pair_accuracy_ci=wilson_interval(wins, len(margins)),
                       margin=float(margins.mean()), pairs=len(margins),
                       logp_accuracy=float((chosen > rejected).float().mean()),
                       prior_logp_accuracy=float((chosen_ref > rejected_ref).float().mean()),
                       **{"logp/chosen": float(chosen.mean()),
                          "logp/rejected": float(rejected.mean())})
    if len(labelled):
        rewards = implicit_rewards(labelled, labelled_ref, beta)
        right = sum(bool(r > 0) if label else bool(r < 0) for r, label in zip(rewards, labels))
        figures.update(label_accuracy=right / len(labels),
                       label_accuracy_ci=wilson_interval(right, len(labels)))
    ratios = [float(x) for x in (chosen - chosen_ref)]
    ratios += [float(x) for x in (rejected - rejected_ref)]
    if ratios:
        figures["kl"] = statistics.fmean(ratios)
    return figures
