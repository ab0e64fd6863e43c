"""In-process clients (httpx ASGITransport + lifespan) over the fake backend."""

import httpx
import pytest
from api_fakes import FakeBackend
from asgi_lifespan import LifespanManager

from scd_serve.api.app import create_app
from scd_serve.config.api import ApiConfig


@pytest.fixture
def backend():
    return FakeBackend()


@pytest.fixture
async def make_client():
    """make(backend, **api_config) -> httpx.AsyncClient on a started app (lifespan run)."""
    managers, clients = [], []

    async def make(backend, **config):
        config.setdefault("max_model_len", 256)
        config.setdefault("max_tokens_cap", 64)
        app = create_app(ApiConfig(**config), backend)
        manager = LifespanManager(app)
        await manager.__aenter__()
        managers.append(manager)
        transport = httpx.ASGITransport(app=manager.app, raise_app_exceptions=False)
        client = httpx.AsyncClient(transport=transport, base_url="http://test")
        client.app = app
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.aclose()
    for m in managers:
        await m.__aexit__(None, None, None)


@pytest.fixture
async def client(backend, make_client):
    return await make_client(backend)
