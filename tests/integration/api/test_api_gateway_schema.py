"""Schemathesis against the gateway's /openapi.json (the workers' schema), with a real decode
worker on the real engine behind it, both real servers: every answer must match its documented
response schema (and status codes), for every operation."""

import pytest
import schemathesis
from api_server import ServerThread, engine_app, stop_engine
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance, status_code_conformance

from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.registry import Registry
from scd_serve.gateway.app import create_gateway_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def gateway_url(tiny_runtime):
    app, engine = engine_app(tiny_runtime, api_kw={"max_tokens_cap": 8})
    with ServerThread(app) as worker:
        gateway = create_gateway_app(GatewayConfig(port=0, decode=(worker.url.removeprefix("http://"),)),
                                     Registry(ttl_s=30))
        with ServerThread(gateway) as front:
            yield front.url
    stop_engine(engine)


def test_every_gateway_answer_matches_the_schema(gateway_url):
    schema = schemathesis.openapi.from_url(gateway_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10  # every route has its 200 schema (responses.py)
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(checks=[not_a_server_error, status_code_conformance, response_schema_conformance])

        check()


def test_one_request_id_from_the_client_through_the_gateway_to_the_worker(gateway_url):
    import httpx

    body = {"prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=gateway_url, timeout=30) as http:
        r = http.post("/v1/completions", json=body, headers={"x-request-id": "trace-7"})
        assert r.headers.get_list("x-request-id") == ["trace-7"] and r.json()["id"] == "cmpl-trace-7"
        r = http.post("/v1/completions", json=body)  # none sent: the gateway's id, taken by the worker
        rid = r.headers["x-request-id"]
        assert r.headers.get_list("x-request-id") == [rid] and r.json()["id"] == f"cmpl-{rid}"
