"""PPO and GRPO for small models: ppo.py and grpo.py, one shared guarded step (step.py), one safety envelope."""
