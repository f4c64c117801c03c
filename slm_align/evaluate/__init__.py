"""Evaluation (stage.py): held-out perplexity, reward and win rate of a run's stages."""
