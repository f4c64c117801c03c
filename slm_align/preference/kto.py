"""KTO inside the safety envelope: labelled completions (thumbs up or down) pulled above or pushed
below a reference point, the policy's KL to the reference on mismatched pairs.

One step, top to bottom: the batch's labelled completions (a seeded shuffle per epoch); the
reference's log-probabilities of them and of their mismatched pairs (each computed once, cached);
the policy's, with gradient, and on the mismatched pairs without (the reference point z_ref); the
loss; the guarded optimizer step (rollback on anything non-finite). After Ethayarajh et al. 2024
(KTO), as TRL's KTOTrainer.
"""

from __future__ import annotations

from typing import Optional

import torch

from slm_align.config import PreferenceSettings
from slm_align.data.preferences import Labelled
from slm_align.envelope.gate import Figure
from slm_align.preference.data import PreferenceData
from slm_align.preference.learner import Encoder, PreferenceLearner, sequence_logprobs
from slm_align.preference.losses import kto_loss, kto_reference_point


class KTO(PreferenceLearner):
    """A KTO run on labelled completions (its shared state:
    :class:`~slm_align.preference.learner.PreferenceLearner`)."""

    algo = "kto"
    unit = "labelled completions"

    def heldout_count(self) -> tuple[str, int]:
        """Both held-out kinds: KTO's labelled completions are measured beside the pairs."""
        return ("held-out pairs and labelled completions",
                len(self.chosen.rows) + len(self.labelled.rows))

    def balance_figures(self, data: PreferenceData, settings: PreferenceSettings) -> list[Figure]:
        """The rarer label's share of the training completions, at least ``min_label_share``."""
        return [Figure("share of the rarer label", data.label_share(), settings.min_label_share,
                       ">=", "Collect more of the rarer verdict (thumbs up or down) before "
                             "training KTO.")]

    def own_figures(self) -> dict:
        """The desirable weight lambda_D it trained with (given, or balanced from the labels)."""
        return {"desirable_weight": self.desirable_weight}

    def prepare(self, data: PreferenceData) -> None:
        """The training completions and their mismatched pairs (reference scores computed on first
        use), the held-out pairs and labelled completions (scored now), the desirable weight."""
        encoded = self.encoder.labelled(data.train_labelled)
        self.train_items = [(row, item.label) for row, item in encoded]
        self.labels = [item.label for _, item in encoded]
        self.train_completions = self.reference([row for row, _ in encoded], now=False)
        mismatched = mismatched_rows(self.encoder, [item for _, item in encoded])
        self.mismatched = self.reference(mismatched, now=False)
        self.answers = {"completions": self.train_completions, "mismatched": self.mismatched}
        self.keep_heldout(data.heldout_pairs, data.heldout_labelled)
        if self.desirable_weight is None:
            self.desirable_weight = balancing_weight(self.labels, self.settings.undesirable_weight)

    def train_step(self) -> dict:
        """One guarded KTO step on the next ``batch_size`` labelled completions; its statistics
        (``rolled_back`` when the envelope undid it).

        With rho = log pi(y|x) - log pi_ref(y|x) summed over the completion's tokens and the
        reference point z_ref = max(0, mean_j rho_j') over the mismatched pairs (no gradient):
        loss = mean_i lambda_D (1 - sigmoid(beta (rho_i - z_ref))) for a desirable completion,
        lambda_U (1 - sigmoid(beta (z_ref - rho_i))) for an undesirable one
        (:func:`~slm_align.preference.losses.kto_loss`; Ethayarajh et al. 2024, eq. 8).
        """
        indices = self.batch_indices(self.step)
        desirable = torch.tensor([self.labels[i] for i in indices], device=self.device)
        # --- reference: (b,) each, every training answer scored once, by the first batch using it
        self.ensure_reference(indices, self.train_completions, self.mismatched)
        # --- policy: the completions with gradient, their mismatched pairs without, dropout off
        snapshot = self.guard.snapshot()
        self.prepare_forward()
        with self.forward_context():
            rows = [self.train_completions.rows[i] for i in indices]
            logp, _ = sequence_logprobs(self.policy, rows, self.pad_id, len(rows))
            with torch.no_grad():
                kl_rows = [self.mismatched.rows[i] for i in indices]
                kl_logp, _ = sequence_logprobs(self.policy, kl_rows, self.pad_id, len(kl_rows))
            # --- loss
            z_ref = kto_reference_point(kl_logp, self.mismatched.ref[indices])
            terms = kto_loss(logp, self.train_completions.ref[indices], desirable, z_ref,
                             self.settings.beta, self.desirable_weight,
                             self.settings.undesirable_weight)
        rewards = terms.rewards.detach()
        stats = {"kl": float(z_ref)}
        if bool(desirable.any()):
            stats["reward/desirable"] = float(rewards[desirable].mean())
        if bool((~desirable).any()):
            stats["reward/undesirable"] = float(rewards[~desirable].mean())
        # --- guarded step: backward, finite loss, gradient and parameters, else the snapshot back
        return self.finish_step(stats, self.guard.step(terms.loss, snapshot, self.after_backward))


def mismatched_rows(encoder: Encoder, items: list[Labelled]) -> list[dict]:
    """The mismatched pairs that estimate z_ref: item i's prompt with the completion of the next item
    (cyclic) that answers another prompt (:func:`mismatched_partners`), or item i itself where truncation
    leaves that pair no token."""
    rows = []
    for item, partner in zip(items, mismatched_partners(items)):
        row = encoder.row(item.prompt, items[partner].completion)
        rows.append(row if row is not None else encoder.row(item.prompt, item.completion))
    return rows


def mismatched_partners(items: list[Labelled]) -> list[int]:
    """For each item, the first item after it (cyclic) whose prompt differs: adjacent rows often share a prompt
    (TRL's unpaired files, regenerations, device feedback on the same question), and a completion of the same
    prompt is no mismatch. The next item when every prompt is the same.

    One walk backwards twice round the circle, O(n): the first later item that differs from item i is item i+1
    when their prompts differ, else the one found for item i+1."""
    n = len(items)
    partners = [(i + 1) % n for i in range(n)]
    differing: Optional[int] = None
    for step in reversed(range(2 * n - 1)):
        i, following = step % n, (step + 1) % n
        if items[following].prompt != items[i].prompt:
            differing = following
        if step < n and differing is not None:
            partners[i] = differing
    return partners


def balancing_weight(labels: list[bool], undesirable_weight: float = 1.0) -> float:
    """KTO's default desirable weight, chosen so that both labels weigh the same in all:
    lambda_D * n_desirable = lambda_U * n_undesirable, so lambda_D = lambda_U * n_U / n_D (1 when a side is
    missing). Ethayarajh et al. 2024 (KTO) recommend lambda_D * n_D / (lambda_U * n_U) in [1, 4/3]; this is 1."""
    good = sum(labels)
    bad = len(labels) - good
    if good == 0 or bad == 0:
        return 1.0
    return undesirable_weight * bad / good
