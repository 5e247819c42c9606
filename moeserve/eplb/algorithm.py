"""EPLB placement: which logical expert each physical expert slot holds, from measured load.

Shape legend: L layers, E logical experts, P physical slots (``num_replicas``), X most replicas
one logical expert can get (``P - E + 1``), G expert groups, N nodes, R ranks (all nodes),
S = P / R slots per rank. B is a batch of independent problems (layers, or layer x node).

Hierarchical form (``num_groups % num_nodes == 0``), three greedy steps::

    1. groups  -> nodes    G/N whole groups per node, heaviest group first onto the lightest
                           node that still has room (a group's experts never leave its node,
                           so group-limited routing keeps tokens on few nodes)
    2. inside each node    its E/N experts get P/N slots: one each, then every extra slot to
                           the expert with the largest load per replica
    3. replicas -> ranks   the node's P/N replicas (load = expert load / its replica count)
                           onto its R/N ranks, S each, heaviest first onto the lightest rank
                           that still has room

Global form (otherwise): the same with one node holding every expert (N = 1, G = 1).

The result is laid out rank-major like ``distributed/ep/placement.py``: rank ``r`` owns slots
``[r*S, (r+1)*S)`` (sorted by logical id inside a rank), node ``n`` owns ranks
``[n*R/N, (n+1)*R/N)``::

    phy2log_LP  [L, P]     logical expert of each slot
    log2phy_LEX [L, E, X]  the slots of each expert, ascending, padded with -1 (X is fixed by
                           the arguments, so the tables keep their shape across rebalances)
    logcnt_LE   [L, E]     replicas of each expert (>= 1, sums to P per layer)

Load bound (tested in ``tests/unit/eplb``). Packing ``n*k`` items into ``n`` packs of exactly
``k`` with the greedy above (items sorted heaviest first) gives

    max pack load <= mean pack load + (1 - 1/n) * max item.

Proof: let pack ``r`` end with items ``r_1 >= ... >= r_m`` (in assignment order). Every other
pack ``q`` ends with load ``>= r_2 + ... + r_m``: if at some step ``i + 1`` (``r`` takes
``r_{i+1}``) ``q`` held fewer than ``i`` items, ``q`` had room, so ``load_q >= r_1 + ... + r_i``
then (``r`` was the lightest with room), which covers ``r_2 .. r_{i+1}``; take the last such
``i``, after it ``q`` takes one more item before each later ``r_j``, each no lighter than it
(heaviest first). If there is no such step, ``q``'s ``j``-th item precedes ``r_{j+1}`` for every
``j``. Summing over the ``n - 1`` other packs: ``n * load_r <= total + (n - 1) * r_1``.
Applied to step 3 inside a node and to step 1 (node load <= mean + (1 - 1/N) * max group load),
with replica load ``w_e / c_e``::

    max rank load <= mean rank load + (1 - 1/N) * max group load / (R/N)
                     + (1 - 1/(R/N)) * max_e (w_e / c_e)

where the mean is over all ranks, and a replica carries an equal share of its expert's load.
"""

from __future__ import annotations

import torch


def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place ``num_replicas`` physical slots over ``num_ranks`` ranks from the load ``weight``
    ``[L, E]`` (tokens per logical expert per layer, any non-negative float or int tensor).

    Returns ``(phy2log [L, P], log2phy [L, E, P - E + 1], logcnt [L, E])``, all int64 on the
    CPU (see the module docstring for the layout). Hierarchical when ``num_groups`` divides by
    ``num_nodes``, global otherwise. Deterministic (ties are broken by index).

    Raises ValueError when the weight is not a finite, non-negative ``[L, E]`` tensor, when
    ``num_replicas`` is below ``E`` or does not divide by ``num_ranks``, when ``num_ranks`` does
    not divide by ``num_nodes``, or when ``E`` does not divide by ``num_groups``.
    """
    w_LE = _check_args(weight, num_replicas, num_groups, num_nodes, num_ranks)
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # global: one node holding one group of every expert
    phy2log_LP = _hierarchical(w_LE, num_replicas, num_groups, num_nodes, num_ranks)
    E = w_LE.shape[1]
    log2phy_LEX, logcnt_LE = placement_tables(phy2log_LP, E, num_replicas - E + 1)
    return phy2log_LP, log2phy_LEX, logcnt_LE


def _check_args(weight, num_replicas, num_groups, num_nodes, num_ranks) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight)
        raise ValueError(f"weight must be a non-empty [layers, experts] tensor, got {shape}")
    w_LE = weight.detach().to("cpu", torch.float64)
    if not torch.isfinite(w_LE).all() or (w_LE < 0).any():
        raise ValueError("weight must be finite and non-negative (tokens per expert)")
    E = w_LE.shape[1]
    sizes = dict(
        num_replicas=num_replicas, num_groups=num_groups, num_nodes=num_nodes, num_ranks=num_ranks
    )
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_replicas < E:
        raise ValueError(
            f"num_replicas={num_replicas} is below the {E} logical experts: every expert "
            "needs at least one slot"
        )
    if num_replicas % num_ranks:
        raise ValueError(
            f"num_replicas={num_replicas} does not split evenly over num_ranks={num_ranks}; "
            "choose a number of redundant experts that makes E + redundant a multiple of it"
        )
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks={num_ranks} does not split evenly over num_nodes={num_nodes}")
    if E % num_groups:
        raise ValueError(f"{E} experts do not split into num_groups={num_groups} equal groups")
    return w_LE


def _hierarchical(w_LE: torch.Tensor, P: int, G: int, N: int, R: int) -> torch.Tensor:
    L, E = w_LE.shape
    gs, E_n, P_n, R_n, S = E // G, E // N, P // N, R // N, P // R
    # 1. groups -> nodes; a group's experts take node-local ids pos*gs .. pos*gs+gs-1, so
    #    "node-major id" (node * E_n + node-local id) orders experts by node
    node_LG, pos_LG = balanced_packing(w_LE.view(L, G, gs).sum(-1), N)
    major_LGI = ((node_LG * (G // N) + pos_LG) * gs).unsqueeze(-1) + torch.arange(gs)
    major_LE = major_LGI.reshape(L, E)
    log_of_major_LE = torch.empty_like(major_LE).scatter_(1, major_LE, torch.arange(E).expand(L, E))
    # 2. replicate inside each node: B = L * N problems of E_n experts and P_n slots
    w_BM = w_LE.gather(1, log_of_major_LE).view(L * N, E_n)
    item_BP, cnt_BM = replicate(w_BM, P_n)
    # 3. the node's replicas -> its ranks
    rep_load_BP = (w_BM / cnt_BM).gather(1, item_BP)
    rank_BP, slot_BP = balanced_packing(rep_load_BP, R_n)
    node_base_B = (torch.arange(L * N) % N) * P_n
    phy_BP = node_base_B.unsqueeze(1) + rank_BP * S + slot_BP
    major_BP = item_BP + ((torch.arange(L * N) % N) * E_n).unsqueeze(1)
    log_LP = log_of_major_LE.gather(1, major_BP.view(L, P))
    phy2log_LP = torch.empty(L, P, dtype=torch.int64).scatter_(1, phy_BP.view(L, P), log_LP)
    return phy2log_LP.view(L, R, S).sort(dim=-1).values.reshape(L, P)


def balanced_packing(load_BM: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the ``M`` items of each row into ``num_packs`` packs of exactly ``M / num_packs``
    items: heaviest item first, each onto the lightest pack that still has room (ties: lower
    pack). Returns ``(pack_BM, index_in_pack_BM)``, int64. One vectorized step per item."""
    B, M = load_BM.shape
    if M % num_packs:
        raise ValueError(f"{M} items do not split into {num_packs} equal packs")
    per_pack = M // num_packs
    order_BM = load_BM.argsort(dim=1, descending=True, stable=True)
    pack_load = torch.zeros(B, num_packs, dtype=torch.float64)
    pack_fill = torch.zeros(B, num_packs, dtype=torch.int64)
    pack_BM = torch.empty(B, M, dtype=torch.int64)
    index_BM = torch.empty(B, M, dtype=torch.int64)
    rows = torch.arange(B)
    load_BM = load_BM.to(torch.float64)
    for i in range(M):
        item_B = order_BM[:, i]
        pack_B = pack_load.masked_fill(pack_fill >= per_pack, float("inf")).argmin(dim=1)
        pack_BM[rows, item_B] = pack_B
        index_BM[rows, item_B] = pack_fill[rows, pack_B]
        pack_load[rows, pack_B] += load_BM[rows, item_B]
        pack_fill[rows, pack_B] += 1
    return pack_BM, index_BM


def replicate(load_BM: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Give each of the ``M`` items of a row one slot, then each further slot to the item with
    the largest load per replica (ties: fewer replicas, then lower item), which minimizes the
    largest load per replica. Returns ``(item_of_slot_BS, count_BM)``, int64."""
    B, M = load_BM.shape
    if num_slots < M:
        raise ValueError(f"{num_slots} slots cannot hold {M} items")
    item_BS = torch.empty(B, num_slots, dtype=torch.int64)
    item_BS[:, :M] = torch.arange(M)
    count_BM = torch.ones(B, M, dtype=torch.int64)
    rows = torch.arange(B)
    load_BM = load_BM.to(torch.float64)
    for s in range(M, num_slots):
        per_replica_BM = load_BM / count_BM
        top_BM = per_replica_BM == per_replica_BM.max(dim=1, keepdim=True).values
        item_B = count_BM.masked_fill(~top_BM, num_slots + 1).argmin(dim=1)
        item_BS[:, s] = item_B
        count_BM[rows, item_B] += 1
    return item_BS, count_BM


def placement_tables(
    phy2log_LP: torch.Tensor, num_logical: int, max_replicas: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log2phy_LEX, logcnt_LE)`` of a slot table: each expert's slots in ascending order,
    padded with -1 to ``max_replicas`` columns (default: the most any expert has).

    Raises ValueError for ids outside ``[0, num_logical)``, an expert without a slot, or an
    expert with more than ``max_replicas`` slots."""
    phy2log_LP = torch.as_tensor(phy2log_LP, dtype=torch.int64)
    if phy2log_LP.dim() != 2:
        raise ValueError(f"phy2log must be [layers, slots], got {tuple(phy2log_LP.shape)}")
    L, P = phy2log_LP.shape
    if P and (int(phy2log_LP.min()) < 0 or int(phy2log_LP.max()) >= num_logical):
        raise ValueError(f"phy2log holds ids outside [0, {num_logical})")
    logcnt_LE = torch.zeros(L, num_logical, dtype=torch.int64)
    logcnt_LE.scatter_add_(1, phy2log_LP, torch.ones_like(phy2log_LP))
    missing = (logcnt_LE == 0).nonzero()
    if len(missing):
        layer, expert = missing[0].tolist()
        raise ValueError(f"layer {layer}: logical expert {expert} has no physical slot")
    X = int(logcnt_LE.max()) if max_replicas is None else max_replicas
    if int(logcnt_LE.max()) > X:
        raise ValueError(f"an expert has {int(logcnt_LE.max())} slots, more than {X}")
    order_LP = phy2log_LP.argsort(dim=1, stable=True)  # slots grouped by expert, ascending
    expert_LP = phy2log_LP.gather(1, order_LP)
    start_LE = logcnt_LE.cumsum(1) - logcnt_LE
    replica_LP = torch.arange(P) - start_LE.gather(1, expert_LP)
    log2phy_LEX = torch.full((L, num_logical, X), -1, dtype=torch.int64)
    log2phy_LEX[torch.arange(L).unsqueeze(1), expert_LP, replica_LP] = order_LP
    return log2phy_LEX, logcnt_LE


def rank_load(weight_LE: torch.Tensor, phy2log_LP: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """``[L, R]`` float64: the load each rank carries when every expert's load is split
    evenly over its replicas (slots are rank-major, ``P / R`` per rank)."""
    w_LE = weight_LE.to("cpu", torch.float64)
    phy2log_LP = torch.as_tensor(phy2log_LP, dtype=torch.int64)
    L, P = phy2log_LP.shape
    if w_LE.dim() != 2 or w_LE.shape[0] != L:
        raise ValueError(f"weight {tuple(w_LE.shape)} and phy2log {(L, P)} disagree on layers")
    if P % num_ranks:
        raise ValueError(f"{P} slots do not split evenly over {num_ranks} ranks")
    _, logcnt_LE = placement_tables(phy2log_LP, w_LE.shape[1])
    slot_load_LP = (w_LE / logcnt_LE).gather(1, phy2log_LP)
    return slot_load_LP.view(L, num_ranks, P // num_ranks).sum(-1)


def imbalance(rank_load_LR: torch.Tensor) -> torch.Tensor:
    """``[L]``: max over mean load per rank of each layer (1.0 is perfect balance; a layer
    without load counts as balanced)."""
    load = rank_load_LR.to(torch.float64)
    mean = load.mean(dim=-1)
    return torch.where(mean > 0, load.max(dim=-1).values / mean.clamp_min(1e-300), 1.0)
