"""ops/cpu/rope.c built for aarch64 (NEON, and SVE at two vector lengths) and run under qemu
(tests/arm/qemu.py), on the inputs of test_mla_rope_cache.py, against the torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.ops.cpu import rope
from tests.arm import qemu
from tests.unit.ops.cpu.test_mla_rope_cache import CASES, make_case

pytestmark = pytest.mark.skipif(qemu.MISSING is not None, reason=qemu.MISSING or "")


@pytest.fixture(scope="module", params=sorted(qemu.CPUS))
def driver(request, tmp_path_factory):
    cpu = request.param
    return cpu, qemu.build_driver("rope", cpu, tmp_path_factory.mktemp("arm"))


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("T,H,N,R,C,Q", CASES)
def test_the_kernel_matches_the_reference_on_arm(driver, interleave, T, H, N, R, C, Q):
    cpu, binary = driver
    case = make_case(T, H, N, R, C, Q)
    base, qkv_a, cache, slots = case["base"], case["qkv_a"], case["cache"], case["slots"]
    positions, cos, sin, norm_w = case["positions"], case["cos"], case["sin"], case["norm_w"]
    dims = [T, H, N, R, C, base.shape[1], 5, qkv_a.shape[1], Q, int(interleave)]
    inputs = [np.array(dims, dtype=np.int64), base.numpy(), qkv_a.numpy(), norm_w.numpy()]
    inputs += [np.array([1e-6], dtype=np.float32), cos.numpy(), sin.numpy(), positions.numpy()]
    inputs += [cache.numpy(), slots.numpy()]
    got_base, got_cache = qemu.run(binary, cpu, inputs)
    b, c = base.clone(), cache.clone()
    q = b[:, 5:].unflatten(1, (H, N + R))
    rope.mla_rope_cache_ref(
        q, qkv_a[:, Q:], norm_w, 1e-6, cos, sin, positions, interleave, c, slots
    )
    torch.testing.assert_close(torch.from_numpy(got_base).view_as(b), b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(got_cache).view_as(c), c, rtol=1e-5, atol=1e-5)
