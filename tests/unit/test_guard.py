"""``ops/cpu/bound.py: Guard``: holds while every recorded attribute is the same object and
every recorded tensor at its address, and fails on each way a bound call's inputs change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeserve.ops.cpu.bound import Guard, pointers


class Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)
        self.register_buffer("counts", torch.zeros(3))
        self.sub = nn.Linear(2, 2)
        self.plain = torch.zeros(2)  # not registered: in __dict__
        self.nothing = None


def _guard(m: Owner) -> Guard:
    same = [(m, n, getattr(m, n)) for n in ("weight", "counts", "sub", "plain", "nothing")]
    return Guard(same, pointers(m.weight, m.counts, m.plain))


def test_it_holds_until_something_changes():
    m = Owner()
    g = _guard(m)
    assert g.holds() and g.holds()
    assert g.dicts == [m._parameters, m._buffers, m._modules, m.__dict__, m.__dict__]


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m, "weight", nn.Parameter(torch.ones(4), requires_grad=False)),
        lambda m: setattr(m.weight, "data", torch.ones(4)),  # same object, new storage
        lambda m: setattr(m, "counts", torch.zeros(3)),
        lambda m: setattr(m, "sub", nn.Linear(2, 2)),
        lambda m: setattr(m, "plain", torch.zeros(2)),
        lambda m: setattr(m, "nothing", nn.Linear(2, 2)),  # None in __dict__ -> a submodule
        lambda m: delattr(m, "plain"),
        lambda m: delattr(m, "weight"),
    ],
    ids=["param", "data", "buffer", "module", "plain", "none-to-module", "del", "del-param"],
)
def test_it_fails_on_each_change(change):
    m = Owner()
    g = _guard(m)
    change(m)
    assert not g.holds()


def test_joined_guards_check_each_and_a_shared_tensor_once():
    a, b = Owner(), Owner()
    shared = torch.zeros(5)
    ga = Guard([(a, "weight", a.weight)], pointers(shared, a.counts))
    gb = Guard([(b, "counts", b.counts)], pointers(shared))
    g = Guard.join([ga, gb])
    assert g.holds() and len(g.tensors) == 2 and g.objs == [a, b]
    b.counts = torch.zeros(3)
    assert not g.holds() and ga.holds()


def test_an_attribute_that_is_not_there_cannot_be_guarded():
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        Guard([(Owner(), "missing", None)])
