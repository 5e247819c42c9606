"""The fused MLA rotary + latent-cache write (ops/cpu/rope.c) against its torch reference, and
the reference against the rotary module the layers use."""

from __future__ import annotations

import pytest
import torch

from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.hf_config import RopeConfig
from moeserve.ops.cpu import rope
from moeserve.ops.cpu.rope import apply_rope

pytestmark = pytest.mark.skipif(rope._library() is None, reason="no C kernels here")


CASES = [(1, 16, 64, 32, 256, 384), (7, 3, 8, 6, 20, 0)]  # T, H, N, R, C, Q


def make_case(T: int, H: int, N: int, R: int, C: int, Q: int) -> dict[str, torch.Tensor]:
    """Inputs of one call: q heads at offset 5 of rows ``base`` (a row stride beyond the
    heads), kv at offset Q of rows ``qkv_a``, a 40-slot cache, 64 table positions (also
    test_arm_rope.py's)."""
    g = torch.Generator().manual_seed(T * 10 + H)
    case = {
        "base": torch.randn(T, H * (N + R) + 5, generator=g),
        "qkv_a": torch.randn(T, Q + C + R, generator=g),
        "cache": torch.randn(40, C + R, generator=g),
        "slots": torch.randperm(40, generator=g)[:T],
        "positions": torch.randint(0, 64, (T,), generator=g),
    }
    case["cos"], case["sin"] = (torch.randn(64, R // 2, generator=g) for _ in range(2))
    case["norm_w"] = torch.randn(C, generator=g)
    return case


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("T,H,N,R,C,Q", CASES)
def test_kernel_matches_reference(interleave, T, H, N, R, C, Q):
    case = make_case(T, H, N, R, C, Q)
    base, qkv_a, cache, slots = case["base"], case["qkv_a"], case["cache"], case["slots"]
    positions, cos, sin, norm_w = case["positions"], case["cos"], case["sin"], case["norm_w"]

    def run(fn):
        b, c = base.clone(), cache.clone()
        q = b[:, 5:].unflatten(1, (H, N + R))  # strided rows, unit-stride heads
        out = fn(q, qkv_a[:, Q:], norm_w, 1e-6, cos, sin, positions, interleave, c, slots)
        return out, b, c

    done, b_k, c_k = run(rope.mla_rope_cache)
    assert done
    _, b_r, c_r = run(rope.mla_rope_cache_ref)
    torch.testing.assert_close(b_k, b_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c_k, c_r, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(c_k[untouched], cache[untouched])  # only the step's slots written


@pytest.mark.parametrize("interleave", [False, True])
def test_rotary_module_looks_up_the_positions_rows(interleave):
    rot = RotaryEmbedding(RopeConfig(theta=10000.0, interleave=interleave), 16, 128)
    x = torch.randn(5, 3, 16)
    pos = torch.tensor([0, 3, 7, 100, 127])
    want = rot(pos, x)
    got = apply_rope(x, rot.cos_cached[pos], rot.sin_cached[pos], interleave)
    torch.testing.assert_close(got, want)


def test_does_not_apply_to_other_dtypes():
    T, H, N, R, C = 2, 2, 4, 4, 8
    q = torch.randn(T, H, N + R, dtype=torch.bfloat16)
    ok = rope.mla_rope_cache(
        q,
        torch.randn(T, C + R),
        torch.ones(C),
        1e-6,
        torch.ones(8, R // 2),
        torch.zeros(8, R // 2),
        torch.tensor([0, 1]),
        False,
        torch.zeros(4, C + R),
        torch.tensor([0, 1]),
    )
    assert ok is False
