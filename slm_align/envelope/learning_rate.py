"""The RL learning rate when the recipe leaves it unset: scaled down with the model's size.

One fixed rate cannot serve both ends of our range. The bundled 2.5M-parameter model needs about
1e-3 for its LoRA to move within a quickstart's 20 iterations. Measured on the real Gemma 3 270M
after SFT (``benchmarks/rl_learning_rate.py``: GRPO, 2 prompts x G=4, brevity reward, 3
iterations, LoRA r=16, alpha=32):

    rate     KL after 2 updates   clip fraction   held-out reward (8 prompts) 1e-3     1.35, then
    0.44      0.22-0.28       0.34 -> 1.00 (every answer empty: the policy ran off) 3e-4     0.08,
    then 0.13      0.05-0.18       0.34 -> 0.83 1e-4     about 0              0.00-0.05       0.34
    -> 0.56 2.5e-5   0.003, then 0.02     0               0.34 -> 0.37 (stalls)

The rule is a power law through the two anchors, ``lr(N) = 1e-3 * (2.6e6 / N) ** 0.5``, clamped to
[1e-5, 1e-3]: 1e-3 up to the bundled model's 2.5M, 1.4e-4 at 135M, 1e-4 at 270M, 7.2e-5 at 500M.
"""

from __future__ import annotations

ANCHOR_PARAMETERS = 2.6e6
"""Just above the bundled model's 2,503,488 weights, where ANCHOR_RATE was tuned
(it keeps exactly 1e-3)."""
ANCHOR_RATE = 1e-3
"""RL learning rate of the bundled model (quickstart: held-out reward +0.43
in 20 PPO iterations)."""
EXPONENT = 0.5
"""How fast the rate falls with size; puts 270M at 1e-4, the rate that moved Gemma 3
270M without running off."""
LOWEST_RATE = 1e-5
"""The paper's rate for 70M-410M models (full PPO updates): a floor no size of ours reaches."""


def default_learning_rate(parameters: int) -> float:
    """AdamW learning rate for the RL adapter of a model with ``parameters`` weights
    (base model, not LoRA)."""
    scaled = ANCHOR_RATE * (ANCHOR_PARAMETERS / max(parameters, 1)) ** EXPONENT
    return min(ANCHOR_RATE, max(LOWEST_RATE, scaled))


def base_parameters(model) -> int:
    """Weights of the model that are not trainable adapter parameters."""
    return sum(parameter.numel() for parameter in model.parameters() if not parameter.requires_grad)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The share of the learning rate used at 0-based iteration ``step`` under a linear warmup of
    ``warmup_steps`` iterations: ``min(1, (step + 1) / (warmup_steps + 1))``; 1 throughout when 0.

    With 2: a third of the rate at iteration 0, two thirds at 1, all of it from 2 on. Adam's first
    update moves every weight by about the rate whatever its gradient (m / sqrt(v) is the gradient's
    sign), so the first iterations are the ones a warmup tames. Our own function, not torch's
    ``LinearLR``: the rate is set from the iteration count at each iteration, so it composes with the
    watchdog's scale and a resumed run needs no scheduler state."""
    return min(1.0, (step + 1) / (warmup_steps + 1))
