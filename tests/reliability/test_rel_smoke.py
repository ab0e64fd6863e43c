"""The stack the suite runs against works and starts clean."""

import pytest

from rel_checks import assert_clean

pytestmark = pytest.mark.timeout(30)


async def test_stack_serves_both_paths_and_is_clean(make_stack):
    stack, base = await make_stack()
    for method in ("identity", "local"):
        r = await stack.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0,
                                                             "scd_method": method})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
    assert stack.fill.stats.num_transfers >= 2
    await assert_clean(stack, base)
