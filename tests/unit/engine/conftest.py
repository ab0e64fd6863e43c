"""The engine tests' started engine over the toy runtime (test_engine_real_model.py has its own)."""

import pytest
from engine_helpers import cfg

from scd_serve.engine.engine import Engine
from scd_serve.testing.fake_runtime import FakeRuntime


@pytest.fixture
async def engine():
    eng = Engine(FakeRuntime(), cfg())
    eng.start()
    yield eng
    await eng.stop(grace_s=1)
