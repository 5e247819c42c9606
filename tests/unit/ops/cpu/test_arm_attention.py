"""ops/cpu/attention.c's aarch64 body (its scores and value updates on SVE for the SVE CPUs,
NEON otherwise) built and run under qemu (tests/arm/qemu.py): test_paged_decode_attention.py's
checks, MLA and GQA, fp32 and bf16 caches, with the kernel call (``attention._call``) sent to
the emulated build instead of the x86 one, against the same gather references and bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.ops.cpu import attention as cpu_attention
from tests.arm import qemu
from tests.unit.ops.cpu.test_paged_decode_attention import check_gqa, check_mla

pytestmark = [
    pytest.mark.skipif(qemu.MISSING is not None, reason=qemu.MISSING or ""),
    # the wrappers check their operands before the call (the x86 library answers that)
    pytest.mark.skipif(not cpu_attention.available(), reason="no x86 kernels to dispatch"),
]
driver = qemu.driver_fixture("attention")
_SCALARS = (0, 1, 2, 3, 4, 5, 7, 8, 10, 11, 14, 15, 16, 17, 18, 20, 22, 24, 25, 26, 27)
_TENSORS = (6, 9, 13, 19, 21, 23)  # q1, q2, cache, table, lens, out


@pytest.fixture
def on_arm(driver, monkeypatch):
    """attention._call runs the emulated build: the scalars and each pointer's memory go to
    the driver, and the memory ``out`` spans comes back into it."""
    cpu, binary = driver

    def call(args: tuple) -> int:
        spans = [qemu.span(args[i]) for i in _TENSORS]
        arrays = [qemu.dims(*(args[i] for i in _SCALARS)), np.array([args[12]], np.float32)]
        for t in spans:
            t = t.view(torch.uint16) if t.dtype == torch.bfloat16 else t
            arrays.append(t.numpy())
        rc, out = qemu.run(binary, cpu, arrays)
        spans[-1].copy_(torch.from_numpy(out))
        return int(rc[0])

    monkeypatch.setattr(cpu_attention, "_call", call)


@pytest.mark.parametrize(
    "lens,bs", [([1], 16), ([17], 16), ([2048], 16), ([333], 7), ([1, 16, 32, 5, 100], 16)]
)
def test_mla_decode_on_arm(on_arm, lens, bs):
    check_mla(lens, bs, seed=len(lens) + bs)


@pytest.mark.parametrize("H,C,R", [(3, 20, 6), (1, 8, 1)])
def test_mla_decode_odd_shapes_on_arm(on_arm, H, C, R):
    check_mla([1, 37, 300], 16, H, C, R, seed=H + C + R)


def test_mla_decode_bf16_cache_on_arm(on_arm):
    check_mla([1, 17, 300], 16, seed=3, cache_dtype=torch.bfloat16)


@pytest.mark.parametrize("H,G,Hd", [(4, 2, 16), (6, 3, 20)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_gqa_decode_on_arm(on_arm, H, G, Hd, cache_dtype):
    check_gqa(H, G, Hd, [1, 16, 17, 300], 16, cache_dtype)
