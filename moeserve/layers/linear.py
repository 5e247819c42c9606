"""Linear and gated-MLP layers with ``[out, in]`` weights (the fast ``F.linear`` layout), plain
and tensor-parallel.

Each layer owns its weight specs: ``weight_specs(prefix)`` maps checkpoint names to the
parameter they fill, and a sharded layer's spec names the range of the checkpoint tensor this
rank reads (``WeightSpec.shard``), so a rank never loads more than its slice. A tensor-parallel
layer's one collective sits in its ``forward``:

    ColumnParallelLinear  W split by output rows; the output stays split   (no collective)
    RowParallelLinear     W split by input columns; partial sums added     (all-reduce over tp)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.distributed.groups import Axis
from moeserve.models.weights import WeightSpec
from moeserve.ops.cpu.bound import Guard, calls_guard
from moeserve.ops.cpu.mlp_decode import GatedMLPDecodeCalls, silu_mul
from moeserve.ops.linear import bind_gated_mlp_decode, linear

_SINGLE = Axis.single("tp")


def copy_into(param: torch.Tensor):
    """A spec loader that copies the checkpoint tensor (or this rank's slice of it) into
    ``param``. A slice shorter than ``param`` along dim 0 (the last shard of a padded vocab)
    fills the leading rows and zeroes the rest."""

    def load(t: torch.Tensor) -> None:
        if t.shape == param.shape:
            param.copy_(t)
        else:
            param[: t.shape[0]].copy_(t)
            param[t.shape[0] :].zero_()

    return load


def split_size(total: int, tp: Axis, what: str) -> int:
    if total % tp.size:
        raise ValueError(
            f"{what} of size {total} does not divide by tensor-parallel size {tp.size}"
        )
    return total // tp.size


def shard_range(full: int, dim: int, start: int, length: int) -> tuple[int, int, int] | None:
    """``WeightSpec.shard`` for entries ``[start, start + length)`` of a dim of size ``full``:
    None when that is the whole dim."""
    return None if (start, length) == (0, full) else (dim, start, length)


def shard_spec(
    full_shape: tuple[int, ...], dst: torch.Tensor, dim: int, index: int, length: int
) -> WeightSpec:
    """Read ``[index * length, (index + 1) * length)`` of dim ``dim`` into ``dst``."""
    shard = shard_range(full_shape[dim], dim, index * length, length)
    return WeightSpec(tuple(full_shape), copy_into(dst), shard)


class Linear(nn.Module):
    """Replicated: every rank holds the whole weight."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
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


class ColumnParallelLinear(Linear):
    """Output features split over ``tp``: rank r computes outputs ``[r * n, (r + 1) * n)``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: Axis = _SINGLE,
        bias: bool = False,
        dtype=torch.float32,
    ) -> None:
        super().__init__(in_features, split_size(out_features, tp, "output"), bias, dtype)
        self.tp, self.full_out = tp, out_features

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        n, r = self.out_features, self.tp.rank
        specs = {
            f"{prefix}.weight": shard_spec((self.full_out, self.in_features), self.weight, 0, r, n)
        }
        if self.bias is not None:
            specs[f"{prefix}.bias"] = shard_spec((self.full_out,), self.bias, 0, r, n)
        return specs


class RowParallelLinear(Linear):
    """Input features split over ``tp``; the partial products are summed over ``tp``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: Axis = _SINGLE,
        bias: bool = False,
        dtype=torch.float32,
        reduce: bool = True,
    ) -> None:
        super().__init__(split_size(in_features, tp, "input"), out_features, bias, dtype)
        self.tp, self.full_in, self.reduce = tp, in_features, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        if self.reduce:
            self.tp.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        k, r = self.in_features, self.tp.rank
        specs = {
            f"{prefix}.weight": shard_spec((self.out_features, self.full_in), self.weight, 1, r, k)
        }
        if self.bias is not None:
            specs[f"{prefix}.bias"] = WeightSpec(tuple(self.bias.shape), copy_into(self.bias))
        return specs


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are fused into one ``[2F, D]`` weight. Few
    fp32 rows (decode) run as three prebound kernel calls (``ops/cpu/mlp_decode.py``; the
    activation is the MoE kernels', within a few ulps of ``F.silu``'s); more rows run the
    projections through their format and the same activation in place. Where the calls do
    not apply (no kernels, switched off) the submodules and ``F.silu`` run: the reference.

    Tensor-parallel over ``tp``: each rank holds F / tp of gate and of up (a column split) and
    the matching columns of down (a row split). With ``reduce=False`` the output is this rank's
    partial sum, for a caller that adds it to other partial sums before one all-reduce.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        dtype=torch.float32,
        tp: Axis = _SINGLE,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.full_intermediate = intermediate
        self.intermediate = split_size(intermediate, tp, "FFN")
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, dtype=dtype, reduce=reduce)
        # few rows' prebound kernel calls (bound on first use; False: switched off)
        self._decode_calls: GatedMLPDecodeCalls | bool | None = None

    def use_decode_calls(self, enabled: bool = True) -> None:
        """Run few rows through the prebound kernel calls (bound again on the next call), or,
        not ``enabled``, through the submodules in torch (what hooks on them see; the
        reference)."""
        self._decode_calls = None if enabled else False

    def decode_calls(self) -> GatedMLPDecodeCalls | None:
        """The prebound calls (``ops/cpu/mlp_decode.py``), bound again where a weight moved;
        None where they do not apply or are switched off."""
        calls = self._decode_calls
        w13, w2 = self.gate_up_proj.weight, self.down_proj.weight
        if calls is None or (calls and not calls.fresh(w13, w2)):
            calls = self._decode_calls = bind_gated_mlp_decode(w13, w2) or False
        return calls or None

    def whole_decode_calls(self) -> GatedMLPDecodeCalls | None:
        """:meth:`decode_calls` where they compute the whole output (no all-reduce after):
        what the decode stack may run in the module's place."""
        return None if self.tp.size > 1 else self.decode_calls()

    def decode_guard(self) -> Guard:
        """What :meth:`whole_decode_calls` checks, as a guard (``ops/cpu/bound.py``): it holds
        while that would return the calls it returned last, bound to the same rows."""
        calls = self._decode_calls
        same = [(self, "tp", self.tp), (self, "_decode_calls", calls)]
        if not calls:
            return Guard(same)
        up, down = self.gate_up_proj, self.down_proj
        same += [(self, "gate_up_proj", up), (up, "weight", calls.gate_up.w)]
        same += [(self, "down_proj", down), (down, "weight", calls.down.w)]
        return calls_guard(calls, same)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        calls = self.decode_calls()
        y = None if calls is None else calls(x)  # None: rows the kernels do not take
        if y is None:
            h = self.gate_up_proj(x)
            # the calls' activation where it applies (a prefill's rows: a few rows of a
            # prompt computed here or there, as a prefix-cache hit splits them, round alike)
            a = None if calls is None else silu_mul(h)
            if a is None:
                gate, up = h.split(self.intermediate, dim=-1)
                a = F.silu(gate) * up
            return self.down_proj(a)
        if self.down_proj.reduce:
            self.tp.all_reduce(y)
        return y

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        w = self.gate_up_proj.weight
        f, d, r = self.intermediate, w.shape[1], self.tp.rank
        full = (self.full_intermediate, d)
        return {
            f"{prefix}.gate_proj.weight": shard_spec(full, w[:f], 0, r, f),
            f"{prefix}.up_proj.weight": shard_spec(full, w[f:], 0, r, f),
            **self.down_proj.weight_specs(f"{prefix}.down_proj"),
        }
