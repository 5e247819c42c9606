"""Expert-parallel dispatch + combine against the single-process ``moe_reference``.

Every rank builds the whole problem from fixed seeds (all ranks' tokens and all experts), runs
its share through ``ep_moe_forward`` and checks both the rows it received and its own output,
so each rank verifies itself and returns only error figures.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeserve.distributed.ep import ExpertPlacement, ep_moe_forward, make_dispatcher
from moeserve.distributed.ep.all_to_all import AllToAllDispatcher
from moeserve.distributed.ep.local import LocalDispatcher
from moeserve.ops.moe import experts_sorted, moe_reference
from tests.distributed.mp import run_ranks
from tests.helpers import sorted_reference

E, D, F_, K = 16, 32, 16, 3
MODES = {"sequential": (False, False), "overlap": (True, False), "two_batch": (True, True)}
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def make_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w13": torch.randn(E, 2 * F_, D, generator=g) / D**0.5,
        "w2": torch.randn(E, D, F_, generator=g) / F_**0.5,
        "s13": torch.randn(2 * F_, D, generator=g) / D**0.5,
        "s2": torch.randn(D, F_, generator=g) / F_**0.5,
    }


def make_tokens(seed: int, T: int, experts: list[int]) -> tuple[torch.Tensor, ...]:
    """``T`` tokens, each choosing ``K`` distinct experts among ``experts``."""
    g = torch.Generator().manual_seed(1000 + seed)
    x_TD = torch.randn(T, D, generator=g)
    pick_TK = torch.rand(T, len(experts), generator=g).topk(K, dim=-1)[1]
    topk_ids_TK = torch.tensor(experts)[pick_TK]
    topk_w_TK = torch.rand(T, K, generator=g) + 0.1
    return x_TD, topk_w_TK, topk_ids_TK


def shared_mlp(x_TD: torch.Tensor, s13: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    gate, up = (x_TD @ s13.T).split(F_, dim=-1)
    return (F.silu(gate) * up) @ s2.T


def placements(ep: int) -> dict[str, ExpertPlacement]:
    g = torch.Generator().manual_seed(7)
    extra = torch.randint(0, E, (ep,), generator=g)
    shuffled = torch.cat([torch.arange(E), extra])[torch.randperm(E + ep, generator=g)]
    return {
        "contiguous": ExpertPlacement.contiguous(E, ep),
        "redundant": ExpertPlacement.contiguous(E, ep, num_redundant=ep),
        "shuffled": ExpertPlacement(shuffled, ep),
    }


def expected_rows(batches, placement: ExpertPlacement, rank: int) -> list[torch.Tensor]:
    """Per local slot: the x rows every source rank sends it, in (source rank, t, k) order
    (the all-to-all dispatcher passes ``offset = source rank * K`` to ``physical_ids``)."""
    S = placement.slots_per_rank
    rows: list[list[torch.Tensor]] = [[] for _ in range(S)]
    for src, (x_TD, _, ids_TK) in enumerate(batches):
        phys_N = placement.physical_ids(ids_TK, offset=src * K).reshape(-1)
        for n, p in enumerate(phys_N.tolist()):
            if p // S == rank:
                rows[p % S].append(x_TD[n // K])
    return [torch.stack(r) if r else torch.empty(0, D) for r in rows]


def run_case(dispatcher, placement, batches, rank, weights, dtype, mode) -> float:
    """Max |EP - reference| / max(1, |reference|) of this rank's output."""
    x_TD, topk_w_TK, topk_ids_TK = batches[rank]
    local = placement.local_logical(rank)
    w13_SFD, w2_SDF = weights["w13"][local].to(dtype), weights["w2"][local].to(dtype)
    s13, s2 = weights["s13"].to(dtype), weights["s2"].to(dtype)
    overlap, two_batch = MODES[mode]
    y_TD = ep_moe_forward(
        x_TD.to(dtype),
        topk_w_TK,
        topk_ids_TK,
        lambda x, w, c: sorted_reference(x, w, c, w13_SFD, w2_SDF),
        lambda x: shared_mlp(x, s13, s2),
        dispatcher,
        placement,
        overlap=overlap,
        two_batch=two_batch,
    )
    assert y_TD.shape == x_TD.shape and y_TD.dtype == dtype
    # the reference in fp32 from the same (rounded) inputs
    x32 = x_TD.to(dtype).float()
    w13, w2 = weights["w13"].to(dtype).float(), weights["w2"].to(dtype).float()
    ref_TD = moe_reference(x32, w13, w2, topk_w_TK, topk_ids_TK)
    ref_TD += shared_mlp(x32, s13.float(), s2.float())
    if x_TD.shape[0] == 0:
        return 0.0
    return float((y_TD.float() - ref_TD).abs().max()) / max(1.0, float(ref_TD.abs().max()))


def check_layout(dispatcher, placement, batches, rank) -> int:
    """Assert the dispatched rows, weights and slot counts; return how many rows arrived."""
    x_TD, topk_w_TK, topk_ids_TK = batches[rank]
    d = dispatcher.dispatch(x_TD, topk_w_TK, topk_ids_TK, placement).wait()
    want = expected_rows(batches, placement, rank)
    assert d.slot_counts == tuple(len(r) for r in want)
    assert torch.equal(d.x_RD, torch.cat(want)) and d.weight_R.dtype == torch.float32
    # combine of rows that are all ones counts each token's K choices
    ones_TD = dispatcher.combine(torch.ones_like(d.x_RD), d.meta).wait()
    assert torch.equal(ones_TD, torch.full_like(x_TD, float(K)))
    return d.x_RD.shape[0]


def ep_worker(rank: int, ep: int, tokens_per_rank: list[int]) -> dict:
    if ep == 1:
        dispatcher = make_dispatcher("local")
    else:
        dispatcher = make_dispatcher("all_to_all", dist.new_group(list(range(ep))))
    weights = make_weights()
    results: dict = {"errors": {}, "received": {}}
    for routing in ("random", "rank0_only"):
        for pname, placement in placements(ep).items():
            if routing == "rank0_only" and pname != "contiguous":
                continue
            experts = placement.local_logical(0) if routing == "rank0_only" else list(range(E))
            batches = [make_tokens(r, T, experts) for r, T in enumerate(tokens_per_rank)]
            results["received"][routing, pname] = check_layout(dispatcher, placement, batches, rank)
            for dtype in (torch.float32, torch.bfloat16):
                for mode in MODES:
                    err = run_case(dispatcher, placement, batches, rank, weights, dtype, mode)
                    results["errors"][routing, pname, dtype, mode] = err
    return results


def raising_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank one fails on purpose")
    dist.barrier()


WORLDS = {1: [5], 2: [4, 7], 4: [7, 0, 1, 12]}


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda ep: f"ep{ep}")
def ep_results(request):
    ep = request.param
    if ep == 1:  # the local dispatcher needs no process group: run in this process
        return ep, [ep_worker(0, 1, WORLDS[1])]
    return ep, run_ranks(ep_worker, ep, WORLDS[ep], timeout=120)


def test_matches_reference(ep_results):
    ep, per_rank = ep_results
    for rank, res in enumerate(per_rank):
        for (routing, pname, dtype, mode), err in res["errors"].items():
            assert err <= TOL[dtype], (ep, rank, routing, pname, dtype, mode, err)


def test_every_row_arrives_once(ep_results):
    ep, per_rank = ep_results
    for key in per_rank[0]["received"]:
        total = sum(res["received"][key] for res in per_rank)
        assert total == sum(WORLDS[ep]) * K, key


def test_rank_receiving_nothing(ep_results):
    ep, per_rank = ep_results
    received = [res["received"]["rank0_only", "contiguous"] for res in per_rank]
    assert received[0] == sum(WORLDS[ep]) * K and not any(received[1:])


def test_local_dispatcher_idle_rank_and_errors():
    placement = ExpertPlacement.contiguous(E, 1, num_redundant=3)
    d = LocalDispatcher().dispatch(
        torch.empty(0, D), torch.empty(0, K), torch.empty(0, K, dtype=torch.long), placement
    )
    assert d.wait().x_RD.shape == (0, D) and d.wait().slot_counts == (0,) * (E + 3)
    with pytest.raises(ValueError, match="ep_size=2"):
        LocalDispatcher().dispatch(
            *make_tokens(0, 2, list(range(E))), ExpertPlacement.contiguous(E, 2)
        )
    with pytest.raises(ValueError, match="explicit process group"):
        AllToAllDispatcher(None)
    with pytest.raises(ValueError, match="unknown dispatcher"):
        make_dispatcher("deepep")


@pytest.mark.parametrize("rows_per_slot", [1, 5, 80])
def test_experts_sorted_matches_reference(rows_per_slot):
    """The fast path the benchmark uses (CPU kernel up to 64 rows a slot, GEMMs above)."""
    w = make_weights()
    counts = (rows_per_slot, 0, 2 * rows_per_slot, 3)
    R = sum(counts)
    x_RD, weight_R = torch.randn(R, D), torch.rand(R)
    w13, w2 = w["w13"][:4].contiguous(), w["w2"][:4].contiguous()
    ref = sorted_reference(x_RD, weight_R, counts, w13, w2)
    torch.testing.assert_close(experts_sorted(x_RD, weight_R, counts, w13, w2), ref)


def test_failing_rank_reports_its_traceback():
    with pytest.raises(AssertionError, match="rank one fails on purpose"):
        run_ranks(raising_worker, 2, timeout=60)
