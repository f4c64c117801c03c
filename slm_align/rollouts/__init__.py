"""What RL, the headroom gate and evaluation share of sampling: completions with their
log-probabilities (completions.py) and agent episodes through the runtime's loop (episodes.py),
their phase clock and the policy backend they sample from."""
