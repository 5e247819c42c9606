"""Weights moved into huge-page memory keep their values, identities and sharing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeserve.ops.cpu import hugepages

pytestmark = pytest.mark.skipif(
    not hugepages.enabled(), reason="transparent huge pages are off on this kernel"
)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.randn(512, 1024), requires_grad=False)  # 2 MB
        self.small = nn.Parameter(torch.randn(8), requires_grad=False)
        self.register_buffer("table", torch.arange(300_000, dtype=torch.int64))
        self.half = self.big[256:].T  # a plain attribute viewing the parameter's storage
        self.derived = torch.randn(700, 700)  # a plain attribute with its own storage


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Tied()
        self.tied = self.inner.big  # the same parameter under a second owner


def _thp_eligible(ptr: int) -> bool:
    """Whether the mapping holding ``ptr`` is advised for huge pages (smaps says so)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    return False


def test_move_keeps_values_identity_and_sharing() -> None:
    m = _Outer()
    before = {n: t.clone() for n, t in m.state_dict().items()}
    half, derived = m.inner.half.clone(), m.inner.derived.clone()
    param, small_ptr = m.inner.big, m.inner.small.data_ptr()
    moved = hugepages.move_to_huge_pages(m)
    assert moved == 512 * 1024 * 4 + 300_000 * 8 + 700 * 700 * 4  # `small` stays put
    assert m.inner.big is param and m.tied is param  # identity kept, tie kept
    for n, t in m.state_dict().items():
        assert torch.equal(t, before[n]), n
    assert torch.equal(m.inner.half, half) and torch.equal(m.inner.derived, derived)
    # the view still shares the parameter's (new) storage
    assert m.inner.half.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
    param[300, 5] = 123.0
    assert m.inner.half[5, 44] == 123.0
    for t in (param, m.inner.table, m.inner.derived):
        assert t.data_ptr() % 4096 == 0
        assert _thp_eligible(t.data_ptr())
    assert m.inner.small.data_ptr() == small_ptr


def test_zeros_and_buffer() -> None:
    z = hugepages.huge_page_zeros((2000, 288), torch.float32)
    assert z.shape == (2000, 288) and z.dtype == torch.float32 and not z.any()
    assert z.data_ptr() % hugepages.HUGE_PAGE == 0 and _thp_eligible(z.data_ptr())
    z[1999, 287] = 1.0  # writable to the last element
    small = hugepages.huge_page_zeros((10, 10), torch.float32)  # below one huge page
    assert small.shape == (10, 10) and not small.any()
    if hugepages.thp_mode() == "madvise":  # (with "always" every mapping is eligible)
        assert not _thp_eligible(small.data_ptr())
    with pytest.raises(ValueError, match="nbytes"):
        hugepages.huge_page_buffer(-1)


def test_opt_out(monkeypatch) -> None:
    monkeypatch.setenv("MOESERVE_HUGE_PAGES", "0")
    m = _Tied()
    ptr = m.big.data_ptr()
    assert hugepages.move_to_huge_pages(m) == 0 and m.big.data_ptr() == ptr
    z = hugepages.huge_page_zeros((4, 4), torch.float32)
    assert z.shape == (4, 4) and not z.any()
