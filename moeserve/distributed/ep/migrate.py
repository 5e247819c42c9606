"""Moving expert weights between EP ranks when the placement of a MoE layer changes (EPLB).

Shape legend: S slots per rank, P = R * S physical slots, R ranks of the EP group,
B bytes of one slot's weights (every tensor of the slot, packed).

Every rank computes the same transfer plan from the old and the new slot table (pure, in
:func:`transfer_plan`): new slot ``j`` of rank ``r`` holding expert ``e`` is filled

    locally    from one of ``r``'s old slots that held ``e`` (no traffic), or
    remotely   from an old replica of ``e`` on another rank: replica ``r % count`` of the
               others, so ranks that need the same hot expert ask different owners

Each rank needs each missing expert once (two new slots of one expert share a copy). The
copies cross in one ``all_to_all_single`` of packed rows over the EP group (gloo and NCCL
take uneven splits in the single-tensor form)::

    send rows  [ to rank 0: experts asc | to rank 1: ... ]    each row B bytes
    recv rows  [ from rank 0: experts asc | from rank 1: ... ]

then every changed slot is written in place (parameters keep their storage, so huge-page
mappings and views stay valid). A slot whose expert does not change is not touched.

The same plan fills a replacement rank's empty slots as it joins an elastic group
(:func:`fill_slots`, old table with ``EMPTY_SLOT`` entries): it receives every expert it
gets, from the members that hold one.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.distributed.ep.placement import EMPTY_SLOT, ExpertPlacement


@dataclass(frozen=True)
class TransferPlan:
    """One rank's part of a re-placement.

    ``local``: ``(new slot, old slot)`` pairs copied inside the rank; ``recv``: ``(new slot,
    source rank, expert)`` filled from another rank; ``send[d]``: the old local slots whose
    weights go to rank ``d``, in the order ``d`` expects them (experts ascending);
    ``recv_order[s]``: the experts coming from rank ``s``, in arrival order."""

    local: tuple[tuple[int, int], ...]
    recv: tuple[tuple[int, int, int], ...]
    send: tuple[tuple[int, ...], ...]
    recv_order: tuple[tuple[int, ...], ...]

    @property
    def num_changed(self) -> int:
        return len(self.local) + len(self.recv)


def transfer_plan(old: ExpertPlacement, new: ExpertPlacement, rank: int) -> TransferPlan:
    """What ``rank`` copies, sends and receives to go from ``old`` to ``new`` (the same for a
    given pair of tables on every rank). Raises ValueError when the tables differ in slots or
    EP size."""
    if (old.num_physical, old.ep_size) != (new.num_physical, new.ep_size):
        raise ValueError(
            f"cannot move from {old.num_physical} slots over {old.ep_size} ranks to "
            f"{new.num_physical} over {new.ep_size}: a re-placement keeps both"
        )
    return table_plan(old.phys2log_P.tolist(), new, rank)


def table_plan(old_P: list[int], new: ExpertPlacement, rank: int) -> TransferPlan:
    """:func:`transfer_plan` from a plain old table, in which ``EMPTY_SLOT`` marks a slot
    that holds nothing yet (a replacement's, elastic EP). Raises ValueError when the tables
    differ in length or an expert of ``new`` has no copy in ``old_P``."""
    if len(old_P) != new.num_physical:
        raise ValueError(f"an old table of {len(old_P)} slots for {new.num_physical}")
    R, S = new.ep_size, new.slots_per_rank
    new_P = new.phys2log_P.tolist()
    holders: dict[int, list[int]] = {}  # expert -> ranks holding it in the old table
    for p, e in enumerate(old_P):
        if e != EMPTY_SLOT and p // S not in holders.setdefault(e, []):
            holders[e].append(p // S)
    lost = sorted(set(new_P) - set(holders))
    if lost:
        raise ValueError(f"experts {lost} have no copy to move from")

    def old_slot(r: int, e: int) -> int:
        return old_P[r * S : (r + 1) * S].index(e)

    # per destination rank: the experts it fetches and from whom (deterministic)
    fetch: list[dict[int, int]] = []
    for r in range(R):
        own = set(old_P[r * S : (r + 1) * S])
        want = {}
        for j in range(S):
            e = new_P[r * S + j]
            if e != old_P[r * S + j] and e not in own and e not in want:
                others = holders[e]
                want[e] = others[r % len(others)]
        fetch.append(want)
    local, recv = [], []
    for j in range(S):
        e, before = new_P[rank * S + j], old_P[rank * S + j]
        if e == before:
            continue
        if e in fetch[rank]:
            recv.append((j, fetch[rank][e], e))
        else:
            local.append((j, old_slot(rank, e)))
    send = tuple(
        tuple(old_slot(rank, e) for e in sorted(fetch[d]) if fetch[d][e] == rank) for d in range(R)
    )
    recv_order = tuple(
        tuple(e for e in sorted(fetch[rank]) if fetch[rank][e] == s) for s in range(R)
    )
    return TransferPlan(tuple(local), tuple(recv), send, recv_order)


def slot_tensors(experts) -> list[torch.Tensor]:
    """The stacked per-slot tensors of a ``FusedExperts`` (``[S, ...]`` each): its fp32/bf16
    weights, or a quantized weight's parts (int8: values and scales; int4: packed codes,
    scales and zero points), moved as they are."""
    out = []
    for w in (experts.w13_EFD, experts.w2_EDF):
        out.extend(w.parts() if hasattr(w, "parts") else [w])
    return out


def _pack(tensors: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
    """``[len(slots), B]`` uint8: each slot's tensors as bytes, back to back."""
    if not slots:
        nbytes = sum(t[0].numel() * t.element_size() for t in tensors)
        return torch.empty(0, nbytes, dtype=torch.uint8, device=tensors[0].device)
    index = torch.tensor(slots, device=tensors[0].device)
    parts = [t.index_select(0, index).reshape(len(slots), -1).view(torch.uint8) for t in tensors]
    return torch.cat(parts, dim=1)


def _unpack_into(row_B: torch.Tensor, tensors: list[torch.Tensor], slot: int) -> None:
    start = 0
    for t in tensors:
        n = t[0].numel() * t.element_size()
        t[slot].copy_(row_B[start : start + n].view(t.dtype).view(t[0].shape))
        start += n


def move_experts(experts, old: ExpertPlacement, new: ExpertPlacement, rank: int, group=None) -> int:
    """Fill this rank's slots of ``experts`` (a ``FusedExperts`` laid out by ``old``) with the
    experts ``new`` gives them. Collective over ``group`` (every rank of the EP group calls it
    with the same tables); ``group=None`` only for one rank. Returns the bytes received.
    Does not change the routing: the caller switches the layer's placement afterwards."""
    return _move(experts, transfer_plan(old, new, rank), rank, new.ep_size, group)


def fill_slots(experts, old_P: list[int], new: ExpertPlacement, rank: int, group=None) -> int:
    """:func:`move_experts` from a plain old table over ``new``'s ranks, whose
    ``EMPTY_SLOT`` entries hold nothing yet (elastic EP: a replacement's slots filled as it
    joins). Collective over ``group`` like it; returns the bytes received."""
    return _move(experts, table_plan(old_P, new, rank), rank, new.ep_size, group)


@torch.no_grad()
def _move(experts, plan: TransferPlan, rank: int, ep_size: int, group) -> int:
    tensors = slot_tensors(experts)
    send_slots = [s for slots in plan.send for s in slots]
    buf_NB = _pack(tensors, send_slots)
    recv_counts = [len(es) for es in plan.recv_order]
    buf_MB = buf_NB.new_empty(sum(recv_counts), buf_NB.shape[1])
    if ep_size > 1:
        if group is None:
            raise ValueError(f"moving experts over {ep_size} ranks needs their group")
        _fault_point(rank, ep_size)
        dist.all_to_all_single(
            buf_MB, buf_NB, recv_counts, [len(s) for s in plan.send], group=group
        )
    # arrival row of each (source rank, expert)
    row_of, row = {}, 0
    for src, es in enumerate(plan.recv_order):
        for e in es:
            row_of[(src, e)] = row
            row += 1
    # read every local source before writing any slot (a source may be overwritten)
    local_src = _pack(tensors, [old_slot for _, old_slot in plan.local])
    for i, (j, _) in enumerate(plan.local):
        _unpack_into(local_src[i], tensors, j)
    for j, src, e in plan.recv:
        _unpack_into(buf_MB[row_of[(src, e)]], tensors, j)
    return buf_MB.numel()


FAULT_ENV = "MOESERVE_FAULT_DIE_IN_EXPERT_MOVE"


def _fault_point(rank: int, ep_size: int) -> None:
    """Fault injection for the elastic-EP tests and chaos runs: with ``FAULT_ENV`` set to
    ``RANK:SIZE``, EP rank RANK of an EP group of SIZE ranks kills itself (SIGKILL) as its
    peers enter a move's all-to-all (once: the group that goes on is smaller)."""
    if os.environ.get(FAULT_ENV) == f"{rank}:{ep_size}":
        os.kill(os.getpid(), signal.SIGKILL)
