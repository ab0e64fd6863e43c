"""The gateway's own endpoints (/version, /openapi.json), the proxied /tokenize and /detokenize, and
its errors in the workers' OpenAI shape (param and code present) - never FastAPI's {"detail"}."""

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI, Request
from test_gateway_proxy import serve

from scd_serve import __version__
from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.registry import Registry
from scd_serve.gateway.app import create_gateway_app

pytestmark = pytest.mark.timeout(30)
KEY = "sk-gateway-key"


def stub_tokenizer() -> FastAPI:
    app = FastAPI()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return {"count": 2, "tokens": [1, 2], "asked": await request.json()}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return {"prompt": "ab"}

    return app


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code", "request_id"} <= set(err), err
    return err


@pytest.fixture
async def gateway():
    server, task, address = await serve(stub_tokenizer())
    app = create_gateway_app(GatewayConfig(decode=(address,), api_key=KEY, max_body_bytes=2048), Registry(ttl_s=30))
    async with LifespanManager(app) as m:
        transport = httpx.ASGITransport(app=m.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     headers={"authorization": f"Bearer {KEY}"}) as c:
            yield c
    server.should_exit = True
    await task


async def test_version_tokenize_detokenize(gateway):
    assert (await gateway.get("/version")).json() == {"version": __version__}
    r = await gateway.post("/tokenize", json={"prompt": "ab"})
    assert r.status_code == 200 and r.json()["asked"] == {"prompt": "ab"}
    assert (await gateway.post("/detokenize", json={"tokens": [1, 2]})).json() == {"prompt": "ab"}


async def test_openapi_is_the_workers_schema(gateway):
    schema = (await gateway.get("/openapi.json")).json()
    assert schema["info"]["title"] == "scd-serve gateway"
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/version",
            "/health"} <= set(schema["paths"])
    body = schema["components"]["schemas"]["CompletionRequest"]
    assert {"n", "best_of", "logprobs", "echo", "logit_bias"} <= set(body["properties"])
    assert body["additionalProperties"] is False  # unknown fields are refused, and the schema says so


async def test_gateway_errors_have_the_openai_shape(gateway):
    assert assert_openai_error(await gateway.get("/nowhere"), 404)["code"] == "not_found"
    assert_openai_error(await gateway.get("/v1/completions"), 405)
    assert assert_openai_error(await gateway.post("/v1/completions", content=b"x" * 4096,
                                                  headers={"content-type": "application/json"}), 413)["param"] is None
    err = assert_openai_error(await gateway.get("/version", headers={"authorization": "Bearer wrong-key"}), 401)
    assert err["code"] == "invalid_api_key"


async def test_no_worker_is_a_503_in_the_same_shape():
    app = create_gateway_app(GatewayConfig(), Registry(ttl_s=30))
    async with LifespanManager(app) as m, httpx.AsyncClient(transport=httpx.ASGITransport(app=m.app),
                                                            base_url="http://gw") as c:
        for path in ("/v1/completions", "/tokenize"):
            err = assert_openai_error(await c.post(path, json={"prompt": "x"}), 503)
            assert err["type"] == "server_error" and err["code"] == "unavailable" and err["param"] is None
        assert_openai_error(await c.get("/health"), 503)
