"""Load and save models and tokenizers (models.py), sample and score with them (generation.py),
and where they compute (accelerator.py)."""
