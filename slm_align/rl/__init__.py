"""PPO and GRPO for small models: one loop, one safety envelope."""
