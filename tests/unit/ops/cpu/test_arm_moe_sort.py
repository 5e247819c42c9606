"""ops/cpu/moe_sort.c built for aarch64 (NEON, and SVE at two vector lengths) and run under
qemu (tests/arm/qemu.py), on the inputs of test_moe_sort.py, against the torch references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.ops.cpu import moe_sort
from tests.arm import qemu

pytestmark = pytest.mark.skipif(qemu.MISSING is not None, reason=qemu.MISSING or "")


@pytest.fixture(scope="module", params=sorted(qemu.CPUS))
def driver(request, tmp_path_factory):
    cpu = request.param
    return cpu, qemu.build_driver("moe_sort", cpu, tmp_path_factory.mktemp("arm"))


@pytest.mark.parametrize("T,K,E", [(1, 7, 65), (8, 7, 65), (5, 3, 4), (64, 2, 9)])
def test_sort_and_combine_match_the_references_on_arm(driver, T, K, E):
    cpu, binary = driver
    g = torch.Generator().manual_seed(T * 100 + K)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    x = torch.randn(T, 16, generator=g)
    dims = np.array([T, K, E, 16], dtype=np.int64)
    G, expert, start, count, token, weight, x_sorted, y = qemu.run(
        binary, cpu, [dims, ids.numpy(), w.numpy(), x.numpy()]
    )
    meta, token_R, weight_R, x_RD = moe_sort.moe_sort_ref(ids, w, x)
    assert int(G[0]) == meta.shape[1]
    assert torch.equal(torch.from_numpy(np.stack((expert, start, count))), meta)
    assert torch.equal(torch.from_numpy(token), token_R)
    assert torch.equal(torch.from_numpy(weight), weight_R)
    assert torch.equal(torch.from_numpy(x_sorted).view(-1, 16), x_RD)
    want = moe_sort.moe_combine_ref(x_RD, token_R, T)
    assert torch.equal(torch.from_numpy(y).view(T, 16), want)


def test_an_id_out_of_range_is_refused_on_arm(driver):
    cpu, binary = driver
    dims = np.array([1, 2, 4, 8], dtype=np.int64)
    ids = np.array([0, 4], dtype=np.int64)
    G = qemu.run(binary, cpu, [dims, ids, np.ones(2, np.float32), np.ones(8, np.float32)])[0]
    assert int(G[0]) == -1
