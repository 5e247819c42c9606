"""The best fixed prefill:decode split of ``N`` like instances for a phased workload.

Every instance has the same layout and is either a prefill or a decode instance; a split is
``P`` prefill and ``D = N - P`` decode instances, ``P`` in ``1..N-1``. The workload is a list
of phases, each ``rate`` requests/s (Poisson) of ``input_len`` prompt and ``output_len``
output tokens for ``duration_s`` seconds, with optional TTFT and TPOT targets. For each split
and phase (``lam`` the phase's rate, ``in`` / ``out`` its lengths):

Prefill side. A prefill instance computes the prompt less its last token, one prompt per
step on each of its ``slots = dp x pp`` replicas (``docs/disaggregation.md``: the decode
instance runs the last prompt token), in ``s_p = prefill_step(1 prompt, in - 1).time_s``.
The arrivals split evenly over the ``P x slots`` servers, so
``rho_p = lam x s_p / (P x slots)``. While ``rho_p < 1`` a server is an M/D/1 queue: the
mean wait is ``E[Wq] = rho_p s_p / (2 (1 - rho_p))`` and its tail is taken as exponential
with that mean, ``P(Wq > y) = rho_p exp(-rho_p y / E[Wq])`` (exact for M/M/1; for M/D/1 the
usual approximation with the right mean and the right chance of waiting at all).

Decode side. Each of the ``D x slots`` decode servers receives ``lam_d = lam / (D x slots)``
requests/s and runs every output token of each (the first comes from its one-token chunk of
the last prompt token), at ``TPOT(B) = decode_plan(batch B, mean context in + out / 2)``. By
Little's law its mean batch solves ``B = lam_d x out x TPOT(max(1, B))`` (bisection). Its
capacity is ``B_max / TPOT(B_max)`` tokens/s, ``B_max`` the largest batch that fits in memory
and ``max_decode_batch`` (the engine's ``max_num_seqs``), so ``rho_d = lam_d x out x
TPOT(B_max) / B_max``. At ``rho_d >= 1`` it runs at ``B_max`` and the rest wait for a slot.

Overload and phases. A side at ``rho >= 1`` builds a backlog of work per server that grows
at ``rho - 1`` seconds per second (a fluid queue); a request arriving at a backlog ``w``
waits ``w`` (the stationary M/D/1 wait applies only where the backlog is empty). The backlog
left at the end of a phase is carried into the next and drains at ``1 - rho``.

A request's TTFT is ``max(prefill wait + s_p, decode admission wait) + KV transfer + 1.5
decode steps`` (the prefill and the decode side admit it at once; the transfer is the
prompt's KV over the link, intra-node when instances share nodes; then the decode side
finishes its current step, on average half of one, and runs the first token's). Its TPOT is
``TPOT(B)``, the same for every request of the phase (batch fluctuations are ignored).
Goodput: ``lam`` times the share of the phase's arrivals (averaged over 200 instants) that
meet both targets; without a target, every request meets it. Over the workload: good
requests / total duration. The best split has the highest goodput, ties going to the one
with the lower peak utilisation.

Colocated instances (``colocated > 1``, e.g. 3 one-rank instances on one 2-core host) split
each device evenly as oversubscribed ranks do (``cost_model.Rank``), all instances assumed
busy: pessimistic for an instance whose neighbours idle. Prefill steps batch no prompts
together: pessimistic for short prompts at high rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from moeserve.planner.cost_model import Rank
from moeserve.planner.hardware import HardwareProfile, load_profile
from moeserve.planner.layout import Layout
from moeserve.planner.memory import kv_cache_bytes
from moeserve.planner.model_spec import ModelSpec, load_model_spec, spec_from_config
from moeserve.planner.search import Workload, decode_plan, largest_batch, prefill_plan

GRID = 200  # arrival instants per phase at which the waits are evaluated
FIRST_TOKEN_STEPS = 1.5  # the decode step under way (half, on average) and the first token's


@dataclass(frozen=True)
class Phase:
    input_len: int
    output_len: int
    rate: float  # requests/s, Poisson arrivals
    duration_s: float
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"phase {name} must be an integer >= 1, got {v!r}")
        _number("phase rate", self.rate, zero_ok=True)
        _number("phase duration_s", self.duration_s)
        for name in ("ttft_ms", "tpot_ms"):
            if getattr(self, name) is not None:
                _number(f"phase {name}", getattr(self, name))


@dataclass(frozen=True)
class Fleet:
    """``instances`` instances of ``layout``; ``colocated`` of them share each node."""

    layout: Layout
    instances: int
    colocated: int = 1
    max_decode_batch: int = 64  # sequences per decode replica: the engine's max_num_seqs
    imbalance: float = 1.0

    def __post_init__(self) -> None:
        if self.instances < 2:
            raise ValueError(
                f"instances must be >= 2 (one prefill and one decode), got {self.instances}"
            )
        if not 1 <= self.colocated <= self.instances:
            raise ValueError(
                f"colocated must be in 1..instances ({self.instances}), got {self.colocated}"
            )
        if self.max_decode_batch < 1:
            raise ValueError(f"max_decode_batch must be >= 1, got {self.max_decode_batch}")
        if self.imbalance < 1:
            raise ValueError(f"imbalance must be >= 1, got {self.imbalance}")

    @property
    def slots(self) -> int:
        """Replicas of an instance that each take their own requests: DP x PP micro-batches."""
        return self.layout.dp * self.layout.pp


@dataclass(frozen=True)
class PhaseCosts:
    """What a phase's requests cost on one instance, whatever the split."""

    prefill_s: float  # one prompt (less its last token) on one replica
    transfer_s: float  # its KV to the decode instance
    max_batch: float  # B_max of a decode replica
    tpot: Callable[[float], float]  # TPOT (s) of a decode replica at a mean batch (>= 1)
    tokens_per_step: float  # 1, or more with MTP


@dataclass(frozen=True)
class PhaseResult:
    phase: Phase
    prefill_util: float
    decode_util: float
    decode_batch: float  # mean sequences per decode replica
    prefill_s: float  # one prompt's prefill step
    transfer_s: float  # its KV's transfer
    ttft_s: float  # mean over the phase's arrivals
    tpot_s: float
    prefill_backlog_s: float  # seconds of work queued per server at the phase's end
    decode_backlog_s: float
    goodput: float  # requests/s meeting both targets

    @property
    def prefill_keeps_up(self) -> bool:
        return self.prefill_util < 1

    @property
    def decode_keeps_up(self) -> bool:
        return self.decode_util < 1


@dataclass(frozen=True)
class SplitResult:
    prefill: int
    decode: int
    phases: tuple[PhaseResult, ...]

    @property
    def goodput(self) -> float:
        """Requests/s meeting the targets over the whole workload."""
        total = sum(r.phase.duration_s for r in self.phases)
        return sum(r.goodput * r.phase.duration_s for r in self.phases) / total

    @property
    def peak_util(self) -> float:
        return max(max(r.prefill_util, r.decode_util) for r in self.phases)


@dataclass(frozen=True)
class PDPrediction:
    fleet: Fleet
    splits: tuple[SplitResult, ...]  # P = 1 .. N-1

    @property
    def best(self) -> SplitResult:
        return min(self.splits, key=lambda s: (-round(s.goodput, 9), s.peak_util, s.prefill))

    def as_dict(self) -> dict:
        """Plain data for JSON: the fleet, every split with its phases, and the best split."""
        f = self.fleet
        return {
            "layout": f.layout.describe(),
            "instances": f.instances,
            "colocated": f.colocated,
            "max_decode_batch": f.max_decode_batch,
            "best": f"{self.best.prefill}:{self.best.decode}",
            "splits": [_split_dict(s) for s in self.splits],
        }


def _split_dict(s: SplitResult) -> dict:
    phases = [
        {**asdict(r), "prefill_keeps_up": r.prefill_keeps_up, "decode_keeps_up": r.decode_keeps_up}
        for r in s.phases
    ]
    return {
        "split": f"{s.prefill}:{s.decode}",
        "prefill": s.prefill,
        "decode": s.decode,
        "goodput": s.goodput,
        "peak_util": s.peak_util,
        "phases": phases,
    }


def predict_splits(
    spec: ModelSpec, hw: HardwareProfile, fleet: Fleet, phases: list[Phase]
) -> PDPrediction:
    """Every split of ``fleet`` under ``phases`` (module docstring: the model). Raises
    ValueError for an empty workload or a layout whose weights do not fit."""
    if not phases:
        raise ValueError("phases: the workload needs at least one phase")
    rank = Rank.of(hw, fleet.layout, colocated=fleet.colocated)
    costs = [_phase_costs(spec, hw, rank, fleet, ph) for ph in phases]
    splits = []
    for p in range(1, fleet.instances):
        results, w_p, w_d = [], 0.0, 0.0
        for ph, c in zip(phases, costs):
            d = fleet.instances - p
            r = _phase(ph, c, p * fleet.slots, d * fleet.slots, w_p, w_d)
            results.append(r)
            w_p, w_d = r.prefill_backlog_s, r.decode_backlog_s
        splits.append(SplitResult(p, fleet.instances - p, tuple(results)))
    return PDPrediction(fleet, tuple(splits))


def _workload(fleet: Fleet, ph: Phase) -> Workload:
    return Workload(ph.input_len, ph.output_len, imbalance=fleet.imbalance)


def _phase_costs(
    spec: ModelSpec, hw: HardwareProfile, rank: Rank, fleet: Fleet, ph: Phase
) -> PhaseCosts:
    w = _workload(fleet, ph)
    pre_w = Workload(max(1, ph.input_len - 1), ph.output_len, imbalance=fleet.imbalance)
    pre = prefill_plan(spec, rank, pre_w, 1)
    best = largest_batch(
        lambda b: decode_plan(spec, rank, w, b), fleet.max_decode_batch, lambda p: p.memory.fits
    )
    if best is None or not pre.memory.fits:
        raise ValueError(
            f"layout {fleet.layout.describe()} with {fleet.colocated} instance(s) per node: "
            f"a {ph.input_len}-token request does not fit in memory"
        )
    link = hw.intra_node if fleet.colocated > 1 else hw.inter_node
    kv = kv_cache_bytes(rank, spec, 1, ph.input_len - 1)
    transfer = link.latency_us * 1e-6 + kv / (link.bandwidth_gbs * 1e9)
    return PhaseCosts(
        pre.step.time_s,
        transfer,
        float(best.batch),
        lambda b: decode_plan(spec, rank, w, max(1.0, b)).latency_s,
        fleet.layout.tokens_per_step,
    )


def _phase(
    ph: Phase, c: PhaseCosts, p_servers: int, d_servers: int, w_p0: float, w_d0: float
) -> PhaseResult:
    """One phase on ``p_servers`` prefill and ``d_servers`` decode replicas that start with
    ``w_p0`` / ``w_d0`` seconds of backlog each."""
    lam_p, lam_d = ph.rate / p_servers, ph.rate / d_servers
    rho_p = lam_p * c.prefill_s
    rho_d = lam_d * ph.output_len * c.tpot(c.max_batch) / c.max_batch
    batch = c.max_batch if rho_d >= 1 else _little(lam_d * ph.output_len, c)
    tpot = c.tpot(batch)
    fixed = c.transfer_s + FIRST_TOKEN_STEPS * tpot * c.tokens_per_step
    ewq = rho_p * c.prefill_s / (2 * (1 - rho_p)) if rho_p < 1 else math.inf
    ttft_slo = ph.ttft_ms / 1e3 if ph.ttft_ms else math.inf
    meets, ttft_sum = 0.0, 0.0
    for i in range(GRID):
        t = (i + 0.5) / GRID * ph.duration_s
        wp = max(0.0, w_p0 + (rho_p - 1) * t)
        wd = max(0.0, w_d0 + (rho_d - 1) * t)
        random_wait = wp == 0 and rho_p < 1
        ttft_sum += max((ewq if random_wait else wp) + c.prefill_s, wd) + fixed
        slack = ttft_slo - fixed
        if wd > slack:
            continue
        y = slack - c.prefill_s
        if random_wait:
            meets += 0.0 if y < 0 else 1.0 - (rho_p * math.exp(-rho_p * y / ewq) if rho_p else 0)
        else:
            meets += 1.0 if wp <= y else 0.0
    tpot_ok = ph.tpot_ms is None or tpot <= ph.tpot_ms / 1e3
    end = ph.duration_s
    return PhaseResult(
        ph,
        rho_p,
        rho_d,
        batch,
        c.prefill_s,
        c.transfer_s,
        ttft_sum / GRID,
        tpot,
        max(0.0, w_p0 + (rho_p - 1) * end),
        max(0.0, w_d0 + (rho_d - 1) * end),
        ph.rate * meets / GRID if tpot_ok else 0.0,
    )


def _little(tokens_per_s: float, c: PhaseCosts) -> float:
    """The mean batch ``B = tokens_per_s x TPOT(max(1, B))`` of a decode replica that keeps
    up (``f(B) = tokens_per_s x TPOT(B) - B`` is positive at 0, negative at ``B_max``)."""
    lo, hi = 0.0, c.max_batch
    for _ in range(40):
        mid = (lo + hi) / 2
        if tokens_per_s * c.tpot(mid) > mid:
            lo = mid
        else:
            hi = mid
    return hi


def _number(name: str, v, zero_ok: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v < 0 or (v == 0 and not zero_ok):
        raise ValueError(f"{name} must be a number {'>= 0' if zero_ok else '> 0'}, got {v!r}")


def predict_on_host(
    model: dict | str | Path,
    phases: list[Phase],
    instances: int = 3,
    hardware: str = "this-machine",
    layout: Layout | None = None,
    max_decode_batch: int = 64,
) -> PDPrediction:
    """``instances`` instances of ``layout`` (default: one rank) all on one host of profile
    ``hardware`` (default: the calibrated ``this-machine``), as the PD benchmark runs them.
    ``model``: a parsed config.json, or what ``load_model_spec`` takes (a model directory,
    a config.json, a built-in name). From a benchmark::

        from bench_model import BENCH_CONFIG
        from moeserve.planner.pd_ratio import Phase, predict_on_host
        pred = predict_on_host(
            {**BENCH_CONFIG, "model_type": "deepseek_v3"},
            [Phase(1024, 8, 0.2, 60, ttft_ms=15000, tpot_ms=600), Phase(64, 128, 0.3, 60)],
        )
        pred.best.prefill, pred.best.decode, pred.as_dict()
    """
    spec = spec_from_config(model, "model") if isinstance(model, dict) else load_model_spec(model)
    fleet = Fleet(layout or Layout(), instances, instances, max_decode_batch)
    return predict_splits(spec, load_profile(hardware), fleet, phases)
