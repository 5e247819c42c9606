"""Suite-wide checks: every engine a test builds must pass ``check_integrity()`` afterwards."""

from __future__ import annotations

import weakref

import pytest

from moeserve.engine.engine import LLMEngine

_engines: weakref.WeakSet[LLMEngine] = weakref.WeakSet()
_original_init = LLMEngine.__init__


def _tracking_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _engines.add(self)


LLMEngine.__init__ = _tracking_init


@pytest.fixture(autouse=True)
def _kv_integrity_after_each_test():
    yield
    for engine in list(_engines):
        engine.scheduler.check_integrity()
