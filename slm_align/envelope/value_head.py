"""PPO's critic in fp32 (envelope rule 3: the value head computes in float32
whatever the policy's dtype)."""

from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    """PPO's critic: a linear map from the policy's last hidden state to a scalar value, in fp32."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) hidden states in, (B, T) float32 values out (autocast off:
        values feed GAE in fp32)."""
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return self.linear(hidden.float()).squeeze(-1)
