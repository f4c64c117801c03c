"""The safety envelope, shared by RL (rl/) and preference optimisation (preference/): the policy
built as merged SFT weights + a fresh LoRA with the trainable check (policy.py), fp32
log-probabilities (logprobs.py), the importance ratio and its guard (ratio.py), the guarded
optimizer step with exact rollback (guard.py), the run state around it (run.py), seeds (seeds.py)
and the data-parallel world (world.py).
"""
