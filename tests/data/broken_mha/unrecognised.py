"""Test data: an attention module whose parameter names the checker does not know."""

import torch
from torch import nn


class Mystery(nn.Module):
    def __init__(self, d_in, d_out, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.alpha = nn.Linear(d_in, 3 * d_out + 1)
        self.omega = nn.Linear(d_out, d_out)

    def forward(self, x):
        return self.omega(self.alpha(x)[..., : self.omega.in_features])
