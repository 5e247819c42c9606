"""The accept/reject rule of speculative decoding, as pure functions (greedy over one
sequence's lists, sampling over tensors of a batch).

A sequence proposes ``n_b <= K`` draft tokens ``d_1 .. d_n``; one target forward gives the
target's distribution at ``n + 1`` positions: ``p_0`` (for ``d_1``), ..., ``p_{n-1}`` (for
``d_n``) and ``p_n`` (the bonus position after the last draft)::

    rows of a sequence     0      1      ...    n-1      n
    target distribution    p_0    p_1           p_{n-1}  p_n
    draft token            d_1    d_2           d_n      -
    draft distribution     q_0    q_1           q_{n-1}  -

Greedy: accept the longest prefix with ``d_{j+1} == argmax p_j``; the token after it is
``argmax p_a`` (the correction, or the bonus when all ``n`` were accepted).

Sampling (Leviathan et al. / Chen et al. 2023): accept ``d_{j+1}`` with probability
``min(1, p_j(d) / q_j(d))``; at the first rejection draw from ``norm(max(p_j - q_j, 0))``; when
all ``n`` are accepted draw the bonus from ``p_n``. The emitted tokens are then distributed
exactly as tokens drawn one by one from the target.

Every sequence accepts its own count ``a_b`` and emits ``a_b + 1`` tokens. Randomness comes in
as arguments (uniforms), so the functions are deterministic and the caller decides which
generator each row draws from. ``reference_rejection_sample`` does the same row by row (the
test oracle).

Shape suffixes: B sequences, K the most drafts of any sequence (rows padded), K1 = K + 1,
V vocabulary.
"""

from __future__ import annotations

import torch


def _check(draft_ids_BK: torch.Tensor, num_drafts_B: torch.Tensor, rows_BK1: torch.Tensor) -> None:
    B, K = draft_ids_BK.shape
    if num_drafts_B.shape != (B,) or rows_BK1.shape[:2] != (B, K + 1):
        raise ValueError(
            f"expected draft_ids [B, K], num_drafts [B] and target rows [B, K+1, ...], got "
            f"{tuple(draft_ids_BK.shape)}, {tuple(num_drafts_B.shape)}, {tuple(rows_BK1.shape)}"
        )
    if bool(((num_drafts_B < 0) | (num_drafts_B > K)).any()):
        raise ValueError(f"num_drafts must lie in [0, {K}], got {num_drafts_B.tolist()}")


def _leading_true(ok_BK: torch.Tensor) -> torch.Tensor:
    """Per row, the number of leading True values."""
    return ok_BK.long().cumprod(dim=1).sum(dim=1)


def _emitted(draft_ids_BK: torch.Tensor, accepted_B: torch.Tensor, last_B: torch.Tensor):
    """``[B, K1]`` tokens: accepted drafts, then ``last`` at index ``accepted``, -1 after."""
    B, K = draft_ids_BK.shape
    out_BK1 = torch.full((B, K + 1), -1, dtype=torch.long, device=draft_ids_BK.device)
    j_K1 = torch.arange(K + 1, device=draft_ids_BK.device)
    keep_BK = j_K1[None, :K] < accepted_B[:, None]
    out_BK1[:, :K] = torch.where(keep_BK, draft_ids_BK.long(), out_BK1[:, :K])
    out_BK1.scatter_(1, accepted_B[:, None], last_B[:, None])
    return out_BK1


def greedy_accept_row(drafts: list[int], target_ids: list[int]) -> list[int]:
    """Longest-prefix acceptance of one sequence's ``n`` drafts against the target's greedy
    tokens at its ``n + 1`` rows. Returns the tokens emitted: the accepted drafts, then
    ``target_ids[accepted]`` (the correction, or the bonus). Plain lists: at the batch sizes a
    CPU verifies, a few compares cost less than a dozen tiny tensor ops per step."""
    a = 0
    while a < len(drafts) and drafts[a] == target_ids[a]:
        a += 1
    return [*drafts[:a], target_ids[a]]


def rejection_sample(
    draft_ids_BK: torch.Tensor,
    num_drafts_B: torch.Tensor,
    draft_probs_BKV: torch.Tensor,
    target_probs_BK1V: torch.Tensor,
    u_accept_BK: torch.Tensor,
    u_final_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling that keeps the target distribution exactly (module docstring).

    ``draft_probs_BKV[b, j]`` is the distribution ``d_{j+1}`` was drawn from, and
    ``target_probs_BK1V[b, j]`` the target's at the same position, both after the same
    penalties, temperature, top-k/top-p (rows need not sum to 1). ``u_accept_BK`` and
    ``u_final_B`` are U[0, 1) draws: ``d_{j+1}`` is kept iff ``u * q(d) < p(d)``; the final
    token is the inverse CDF of its distribution at ``u_final``. Returns ``accepted_B`` (drafts
    kept, ``0 <= a_b <= n_b``) and ``tokens_BK1``: row ``b`` emits ``tokens_BK1[b, :a_b + 1]``
    (the kept drafts, then the final token); the rest is -1.
    """
    _check(draft_ids_BK, num_drafts_B, target_probs_BK1V)
    B, K = draft_ids_BK.shape
    dev = draft_ids_BK.device
    if draft_probs_BKV.shape[:2] != (B, K) or u_accept_BK.shape != (B, K):
        raise ValueError(
            f"expected draft_probs [B={B}, K={K}, V] and u_accept [B, K], got "
            f"{tuple(draft_probs_BKV.shape)} and {tuple(u_accept_BK.shape)}"
        )
    p_BK1V = target_probs_BK1V.double()
    p_BK1V = p_BK1V / p_BK1V.sum(dim=-1, keepdim=True)
    q_BKV = draft_probs_BKV.double()
    q_BKV = q_BKV / q_BKV.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    ids_BK1 = draft_ids_BK.long()[:, :, None]
    p_x_BK = p_BK1V[:, :K].gather(2, ids_BK1).squeeze(2)
    q_x_BK = q_BKV.gather(2, ids_BK1).squeeze(2)
    j_K = torch.arange(K, device=dev)
    ok_BK = (u_accept_BK.double() * q_x_BK < p_x_BK) & (j_K[None, :] < num_drafts_B[:, None])
    accepted_B = _leading_true(ok_BK)

    # the final token's distribution: the residual at the first rejection, else p_n (bonus)
    rows_B = torch.arange(B, device=dev)
    p_final_BV = p_BK1V[rows_B, accepted_B]
    rejected_B = accepted_B < num_drafts_B
    if bool(rejected_B.any()):
        q_at_BV = q_BKV[rows_B, accepted_B.clamp_max(max(K - 1, 0))]
        residual_BV = (p_final_BV - q_at_BV).clamp_min(0)
        # p == q leaves no residual mass; then nothing was rejectable and p is the answer
        usable_B = rejected_B & (residual_BV.sum(dim=-1) > 0)
        p_final_BV = torch.where(usable_B[:, None], residual_BV, p_final_BV)
    last_B = inverse_cdf(p_final_BV, u_final_B.double())
    return accepted_B, _emitted(draft_ids_BK, accepted_B, last_B)


def inverse_cdf(probs_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds ``u * total``; a token of
    probability 0 never wins."""
    cdf_BV = probs_BV.double().cumsum(dim=-1)
    target_B1 = (u_B.double() * cdf_BV[:, -1]).unsqueeze(1)
    tokens_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(1)
    tokens_B.clamp_max_(probs_BV.shape[1] - 1)
    bad_B = probs_BV.gather(1, tokens_B[:, None]).squeeze(1) == 0
    if bool(bad_B.any()):
        tokens_B[bad_B] = probs_BV[bad_B].argmax(dim=-1)
    return tokens_B


# --------------------------------------------------------------------------------------------
# Per-row reference (test oracle)


def reference_rejection_sample(
    drafts: list[int],
    draft_probs_KV: torch.Tensor,
    target_probs_K1V: torch.Tensor,
    u_accept: list[float],
    u_final: float,
) -> list[int]:
    """One sequence, token by token, with the same uniforms as :func:`rejection_sample`."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = target_probs_K1V[j].double() / target_probs_K1V[j].double().sum()
        q = draft_probs_KV[j].double() / draft_probs_KV[j].double().sum()
        if u_accept[j] * q[d] < p[d]:
            out.append(d)
            continue
        residual = (p - q).clamp_min(0)
        dist = residual if residual.sum() > 0 else p
        return out + [_reference_inverse_cdf(dist, u_final)]
    p = target_probs_K1V[len(drafts)].double()
    return out + [_reference_inverse_cdf(p / p.sum(), u_final)]


def _reference_inverse_cdf(probs_V: torch.Tensor, u: float) -> int:
    cdf = probs_V.cumsum(dim=0)
    for tok in range(probs_V.numel()):
        if cdf[tok] > u * cdf[-1] and probs_V[tok] > 0:
            return tok
    return int(probs_V.argmax())
