"""The accept/reject rule alone: vectorized against the per-row reference, and statistically
(speculative sampling must give the target's distribution, whatever the draft)."""

from __future__ import annotations

import pytest
import torch

from moeserve.spec.rejection import (
    greedy_accept_row,
    inverse_cdf,
    reference_rejection_sample,
    rejection_sample,
)


def _rows(tokens_BK1: torch.Tensor, accepted_B: torch.Tensor) -> list[list[int]]:
    return [tokens_BK1[b, : int(a) + 1].tolist() for b, a in enumerate(accepted_B)]


def test_greedy_longest_prefix_per_sequence():
    drafts = [[5, 6, 7], [5, 6, 7], [5, 6, 7], [], [1]]
    target = [[5, 6, 7, 8], [5, 2, 7, 8], [4, 6, 7, 8], [3], [1, 4]]
    got = [greedy_accept_row(d, t) for d, t in zip(drafts, target, strict=True)]
    assert got == [[5, 6, 7, 8], [5, 2], [4], [3], [1, 4]]


def test_greedy_never_reads_past_the_drafts():
    # the target row after the last draft is the bonus, whatever it equals
    assert greedy_accept_row([3], [3, 4, 5]) == [3, 4]
    assert greedy_accept_row([3, 4], [3, 4, 4]) == [3, 4, 4]


def test_rejection_sample_matches_reference():
    g = torch.Generator().manual_seed(0)
    B, K, V = 16, 3, 7
    p = torch.rand(B, K + 1, V, generator=g) ** 3
    q = torch.rand(B, K, V, generator=g) ** 3
    p[0, 0, 2] = 0  # zeros on either side
    q[1, 0, :3] = 0
    num = torch.randint(0, K + 1, (B,), generator=g)
    drafts = torch.stack(
        [torch.multinomial(q[:, j], 1, generator=g).squeeze(1) for j in range(K)], dim=1
    )
    u_acc = torch.rand(B, K, generator=g, dtype=torch.float64)
    u_fin = torch.rand(B, generator=g, dtype=torch.float64)
    accepted, tokens = rejection_sample(drafts, num, q, p, u_acc, u_fin)
    for b in range(B):
        n = int(num[b])
        want = reference_rejection_sample(
            drafts[b, :n].tolist(), q[b], p[b], u_acc[b].tolist(), float(u_fin[b])
        )
        assert _rows(tokens, accepted)[b] == want
        assert int(accepted[b]) <= n


def test_identical_distributions_accept_everything():
    g = torch.Generator().manual_seed(1)
    B, K, V = 8, 4, 5
    q = torch.rand(B, K, V, generator=g)
    p = torch.cat([q, torch.rand(B, 1, V, generator=g)], dim=1)
    drafts = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(K)], 1)
    accepted, _ = rejection_sample(
        drafts,
        torch.full((B,), K),
        q,
        p,
        torch.rand(B, K, generator=g, dtype=torch.float64),
        torch.rand(B, generator=g, dtype=torch.float64),
    )
    assert accepted.tolist() == [K] * B


def test_bad_shapes_are_reported():
    q, u = torch.ones(1, 2, 4), torch.zeros(1, 2)
    with pytest.raises(ValueError, match="num_drafts must lie"):
        rejection_sample(
            torch.zeros(1, 2, dtype=torch.long), torch.tensor([3]), q, torch.ones(1, 3, 4), u, u[0]
        )
    with pytest.raises(ValueError, match="expected draft_ids"):
        rejection_sample(
            torch.zeros(1, 2, dtype=torch.long), torch.tensor([1]), q, torch.ones(1, 2, 4), u, u[0]
        )


# --------------------------------------------------------------------------------------------
# Statistics: a Markov-chain "model" generates with speculative steps; its transitions must
# follow the target chain P, not the draft chain Q.

V = 4
# chi-square critical value, df = V * (V - 1) = 12, p = 0.001 (tables); the sum over the V rows
# of P of the per-row statistics (df V - 1 each)
CHI2_DF12_P001 = 32.91


def _chains(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    P = torch.rand(V, V, generator=g, dtype=torch.float64) + 0.05
    Q = torch.rand(V, V, generator=g, dtype=torch.float64) ** 2 + 0.01
    Q[:, 0] = 0  # the draft never proposes token 0: only the residual can emit it
    return P / P.sum(1, keepdim=True), Q / Q.sum(1, keepdim=True)


def _generate(P, Q, k: int, n_tokens: int, seed: int, rule=rejection_sample) -> list[int]:
    """Speculative generation of ``n_tokens`` tokens in batches of 64 independent chains."""
    g = torch.Generator().manual_seed(seed)
    B = 64
    seqs = [[int(t)] for t in torch.randint(0, V, (B,), generator=g)]
    while sum(len(s) for s in seqs) < n_tokens:
        drafts = torch.zeros(B, k, dtype=torch.long)
        q = torch.zeros(B, k, V, dtype=torch.float64)
        p = torch.zeros(B, k + 1, V, dtype=torch.float64)
        last = torch.tensor([s[-1] for s in seqs])
        for j in range(k):
            q[:, j] = Q[last]
            p[:, j] = P[last]
            last = torch.multinomial(Q[last], 1, generator=g)[:, 0]
            drafts[:, j] = last
        p[:, k] = P[last]
        u_acc = torch.rand(B, k, generator=g, dtype=torch.float64)
        u_fin = torch.rand(B, generator=g, dtype=torch.float64)
        accepted, tokens = rule(drafts, torch.full((B,), k), q, p, u_acc, u_fin)
        for b, row in enumerate(_rows(tokens, accepted)):
            seqs[b] += row
    return seqs


def _chi2(seqs: list[list[int]], P: torch.Tensor) -> float:
    counts = torch.zeros(V, V, dtype=torch.float64)
    for s in seqs:
        for a, b in zip(s, s[1:]):
            counts[a, b] += 1
    expected = counts.sum(1, keepdim=True) * P
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_sampling_keeps_the_target_distribution(k):
    P, Q = _chains(0)
    seqs = _generate(P, Q, k, 30_000, seed=k)
    assert _chi2(seqs, P) < CHI2_DF12_P001


def test_a_broken_rule_fails_the_statistical_test():
    P, Q = _chains(0)

    def always_accept(drafts, num, q, p, u_acc, u_fin):
        B, K = drafts.shape
        last = torch.multinomial(p[:, K].float(), 1)[:, 0]
        return torch.full((B,), K), torch.cat([drafts, last[:, None]], dim=1)

    def resample_from_p(drafts, num, q, p, u_acc, u_fin):
        # the right acceptance, but a rejection redraws from p instead of max(p - q, 0)
        accepted, tokens = rejection_sample(drafts, num, q, p, u_acc, u_fin)
        rows = torch.arange(drafts.shape[0])
        redraw = inverse_cdf(p[rows, accepted], u_fin)
        rejected = accepted < num
        tokens[rows[rejected], accepted[rejected]] = redraw[rejected]
        return accepted, tokens

    torch.manual_seed(0)
    assert _chi2(_generate(P, Q, 2, 30_000, seed=5, rule=always_accept), P) > 10 * CHI2_DF12_P001
    # the sanity of the test itself: the proper rule on the same draws passes
    assert _chi2(_generate(P, Q, 2, 30_000, seed=5), P) < CHI2_DF12_P001
    assert _chi2(_generate(P, Q, 2, 30_000, seed=5, rule=resample_from_p), P) > CHI2_DF12_P001
