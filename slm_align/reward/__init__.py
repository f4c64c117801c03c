"""The reward side: preference pairs, the Bradley-Terry reward model, and reward functions."""
