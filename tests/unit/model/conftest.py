"""Fixtures shared by the model tests."""

import pytest


@pytest.fixture(params=["in place", "gathered"])
def attention_path(request, monkeypatch):
    """Decode steps of several sequences read the pool in place, or (small tables) gather it."""
    import scd_serve.model.step as step

    monkeypatch.setattr(step, "GATHER_BYTES", 0 if request.param == "in place" else 1 << 40)
    return request.param
