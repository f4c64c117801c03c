"""DPO inside the safety envelope: the sigmoid loss on the implicit-reward margin of each pair.

One step, top to bottom: the batch's pairs (a seeded shuffle per epoch); the reference's
log-probabilities of their answers (each computed once, cached); the policy's, chosen and rejected
in one forward with dropout off; the loss; the guarded optimizer step (rollback on anything
non-finite). After Rafailov et al. 2023 (DPO), as TRL's DPOTrainer with loss_type "sigmoid".
"""

from __future__ import annotations

from slm_align.preference.data import PreferenceData
from slm_align.preference.learner import PreferenceLearner, sequence_logprobs
from slm_align.preference.losses import dpo_loss


class DPO(PreferenceLearner):
    """A DPO run on pairs (its shared state:
    :class:`~slm_align.preference.learner.PreferenceLearner`)."""

    algo = "dpo"
    unit = "pairs"

    def prepare(self, data: PreferenceData) -> None:
        """The training pairs (their reference scores computed on first use) and the held-out
        pairs (scored now); DPO measures no labelled completions."""
        self.train_items = self.encoder.pairs(data.train_pairs)
        self.train_chosen, self.train_rejected = self.reference_pair(self.train_items, now=False)
        self.answers = {"chosen": self.train_chosen, "rejected": self.train_rejected}
        self.keep_heldout(data.heldout_pairs, [])
        if self.desirable_weight is None:
            self.desirable_weight = 1.0  # KTO's weight: DPO has no labels to balance

    def train_step(self) -> dict:
        """One guarded DPO step on the next ``batch_size`` pairs; its statistics (``rolled_back``
        when the envelope undid it).

        With the implicit reward of an answer y to prompt x, r(y) = beta * (log pi(y|x) -
        log pi_ref(y|x)), log-probabilities summed over y's tokens, and (b,) chosen and rejected
        answers: loss = mean_i -log sigmoid(r(chosen_i) - r(rejected_i))
        (:func:`~slm_align.preference.losses.dpo_loss`; Rafailov et al. 2023, eq. 7).
        """
        indices = self.batch_indices(self.step)
        # --- reference: (b,) each, every training answer scored once, by the first batch using it
        self.ensure_reference(indices, self.train_chosen, self.train_rejected)
        # --- policy: chosen then rejected answers in one forward with dropout off, (2b,) sums
        snapshot = self.guard.snapshot()
        self.prepare_forward()
        with self.forward_context():
            rows = [self.train_chosen.rows[i] for i in indices]
            rows += [self.train_rejected.rows[i] for i in indices]
            logp, _ = sequence_logprobs(self.policy, rows, self.pad_id, len(rows))
            chosen, rejected = logp[:len(indices)], logp[len(indices):]
            # --- loss
            terms = dpo_loss(chosen, rejected, self.train_chosen.ref[indices],
                             self.train_rejected.ref[indices], self.settings.beta)
        margins = terms.rewards.detach()
        stats = {"accuracy": float((margins > 0).float().mean()), "margin": float(margins.mean()),
                 "logp/chosen": float(chosen.detach().mean()),
                 "logp/rejected": float(rejected.detach().mean())}
        # --- guarded step: backward, finite loss, gradient and parameters, else the snapshot back
        return self.finish_step(stats, self.guard.step(terms.loss, snapshot, self.after_backward))
