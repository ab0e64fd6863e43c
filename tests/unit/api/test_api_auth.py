"""Checklist K1/K2: API key on every route but /live, /ready and /health; constant-time compare; never logged."""

import logging
from unittest import mock

import pytest
from api_fakes import FakeBackend
from fastapi.routing import APIRoute
from starlette.routing import Route

import scd_serve.api.auth as auth

pytestmark = pytest.mark.timeout(30)
KEY = "sk-test-0123456789"


@pytest.fixture
async def keyed(make_client):
    return await make_client(FakeBackend(), api_key=KEY)


def all_routes(routes):
    """Flatten app.routes: FastAPI keeps included routers as one entry holding the original router."""
    for r in routes:
        if isinstance(r, (APIRoute, Route)):
            yield r
        elif hasattr(r, "original_router"):
            yield from all_routes(r.original_router.routes)
        else:
            raise AssertionError(f"unknown route kind {type(r)}: extend the walk, or K1 misses routes")


async def test_every_route_but_health_needs_the_key(keyed):
    routes = list(all_routes(keyed.app.routes))
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/openapi.json"} <= {
        r.path for r in routes}
    for route in routes:
        for method in route.methods - {"HEAD"}:
            path = route.path.replace("{", "").replace("}", "")
            r = await keyed.request(method, path, json={"prompt": "x"})
            if route.path in ("/live", "/ready", "/health"):
                assert r.status_code == 200, route.path
            else:
                assert r.status_code == 401, (method, route.path, r.status_code)
                assert r.json()["error"]["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
    r = await keyed.get("/no/such/route")  # unknown paths too: nothing is learnt without a key
    assert r.status_code == 401


@pytest.mark.parametrize("headers,params", [
    ({"Authorization": "Bearer wrong-key-0000000"}, None),
    ({"Authorization": f"Bearer {KEY} "}, None),
    ({"Authorization": f"Basic {KEY}"}, None),
    ({"Authorization": KEY}, None),
    ({}, {"api_key": KEY}),
    ({}, {"key": KEY}),
])
async def test_wrong_or_misplaced_keys_are_401(keyed, headers, params):
    r = await keyed.post("/v1/completions", json={"prompt": "x"}, headers=headers, params=params)
    assert r.status_code == 401


async def test_right_key_works_and_compare_digest_is_used(keyed, caplog):
    with mock.patch.object(auth.secrets, "compare_digest", wraps=auth.secrets.compare_digest) as cd, \
            caplog.at_level(logging.DEBUG):
        r = await keyed.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"})
        bad = await keyed.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 200 and bad.status_code == 401
    assert cd.call_count == 2
    assert KEY not in caplog.text


def test_key_is_not_in_the_config_repr():
    from scd_serve.config.api import ApiConfig
    assert KEY not in repr(ApiConfig(api_key=KEY))
