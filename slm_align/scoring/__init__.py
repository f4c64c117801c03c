"""Measures of a model shared by the stages: perplexity, and the trained Bradley-Terry reward
model as a scorer and as a reward function."""
