"""Fixtures shared by the serving tests."""

import pytest

from serving_helpers import tiny_runtime


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    return tiny_runtime(tmp_path_factory.mktemp("tiny"))
