"""The expert sort / combine kernels of ops/cpu/moe_sort.c against their torch references."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.cpu import moe_sort

pytestmark = pytest.mark.skipif(not moe_sort.available(), reason="no CPU kernels here")


@pytest.mark.parametrize("T,K,E", [(1, 7, 65), (8, 7, 65), (5, 3, 4), (64, 2, 9)])
def test_sort_and_combine_match_the_references(T, K, E):
    g = torch.Generator().manual_seed(T * 100 + K)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    x = torch.randn(T, 2 * 16, generator=g)[:, :16]  # rows with a stride
    got = moe_sort.moe_sort(ids, w, x, E)
    want = moe_sort.moe_sort_ref(ids, w, x)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    y = torch.randn(T * K, 16, generator=g)
    assert torch.equal(moe_sort.moe_combine(y, got[1], T), moe_sort.moe_combine_ref(y, want[1], T))


def test_sort_rejects_ids_out_of_range():
    ids = torch.tensor([[0, 4]])
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        moe_sort.moe_sort(ids, torch.ones(1, 2), torch.ones(1, 8), 4)
