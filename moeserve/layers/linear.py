"""Plain linear and gated-MLP layers with ``[out, in]`` weights (the fast ``F.linear`` layout).

Each layer owns its weight specs: ``weight_specs(prefix)`` maps checkpoint names to the
parameter they fill. Tensor parallelism will subclass these with sharding weight loaders.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.models.weights import WeightSpec
from moeserve.ops.linear import linear


def copy_into(param: torch.Tensor):
    """A spec loader that copies the checkpoint tensor into ``param`` (shapes already checked)."""

    def load(t: torch.Tensor) -> None:
        param.copy_(t)

    return load


class Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        specs = {f"{prefix}.weight": WeightSpec(tuple(self.weight.shape), copy_into(self.weight))}
        if self.bias is not None:
            specs[f"{prefix}.bias"] = WeightSpec(tuple(self.bias.shape), copy_into(self.bias))
        return specs


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are fused into one ``[2F, D]`` weight."""

    def __init__(self, hidden: int, intermediate: int, dtype=torch.float32) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, dtype=dtype)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        w = self.gate_up_proj.weight
        f, d = self.intermediate, w.shape[1]
        return {
            f"{prefix}.gate_proj.weight": WeightSpec((f, d), copy_into(w[:f])),
            f"{prefix}.up_proj.weight": WeightSpec((f, d), copy_into(w[f:])),
            **self.down_proj.weight_specs(f"{prefix}.down_proj"),
        }
