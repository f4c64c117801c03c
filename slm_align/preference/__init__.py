"""Preference optimisation straight from preference files: DPO on pairs, KTO on unpaired thumbs."""
