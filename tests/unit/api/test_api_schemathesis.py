"""Checklist A9: property-based fuzzing of the OpenAPI schema, in process, fixed seed."""

import pytest
import schemathesis
from api_fakes import FakeBackend
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance, status_code_conformance

from scd_serve.api.app import create_app
from scd_serve.config.api import ApiConfig

app = create_app(ApiConfig(max_model_len=256, max_tokens_cap=64), FakeBackend(reply="ok"))
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.mark.timeout(120)
@schema.parametrize()
@settings(max_examples=50, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_schema_fuzz(case):
    case.call_and_validate(checks=[not_a_server_error, status_code_conformance, response_schema_conformance])
