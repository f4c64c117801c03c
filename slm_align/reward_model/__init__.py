"""The reward-model stage: a Bradley-Terry reward model trained on preference pairs (stage.py);
the trained model as a scorer lives in :mod:`slm_align.scoring`."""
