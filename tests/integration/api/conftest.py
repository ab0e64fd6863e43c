"""One tiny random llama for the whole API integration session (built, never downloaded)."""

import pytest


@pytest.fixture(scope="session")
def tiny_runtime(tmp_path_factory):
    from scd_serve.model import ModelRuntime
    from scd_serve.model.tiny import save_tiny_model
    return ModelRuntime.load(save_tiny_model(tmp_path_factory.mktemp("tiny-api"), "llama"))
