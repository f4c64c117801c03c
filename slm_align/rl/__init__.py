"""PPO and GRPO for small models: ppo.py and grpo.py, each one iteration top to bottom, on the
shared run state and minibatch pieces of learner.py, inside one safety envelope
(slm_align/envelope/)."""
