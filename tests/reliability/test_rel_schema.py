"""A9. schemathesis over the app's own /openapi.json, in-process (ASGI), fixed seed.

The backend is a real Engine on the tiny model with the "local" method only: schemathesis
drives the app from its own event loop (starlette TestClient), where the decode side's
gRPC channels (bound to another loop) cannot be used; the transfer path is covered by the
other sections. SCD_SCHEMA_EXAMPLES raises the per-operation count for the documented run
(docs/reliability.md: 600 per POST route, positive + negative -> > 1000 cases).
"""

import os

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from scd_serve.api.app import create_app
from scd_serve.api.backend import EngineBackend
from scd_serve.config.api import ApiConfig
from scd_serve.config.engine import EngineConfig
from scd_serve.engine.engine import Engine

EXAMPLES = int(os.environ.get("SCD_SCHEMA_EXAMPLES", "50"))
pytestmark = pytest.mark.timeout(int(os.environ.get("SCD_SCHEMA_TIMEOUT", "240")))
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def app(rt):
    engine = Engine(rt, EngineConfig(num_blocks=64, block_size=8, max_model_len=256, max_num_seqs=8,
                                     max_concurrent=16))
    engine.start()
    # max_tokens_cap 8: every valid request generates at most 8 tokens, so 1000 cases stay fast
    app = create_app(ApiConfig(max_model_len=256, max_tokens_cap=8, default_max_tokens=4), EngineBackend(engine, "tiny"))
    app.engine = engine
    yield app
    engine._stop.set()
    engine._wake.set()


def test_a9_schemathesis_no_server_errors_no_schema_violations(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    tally = {"cases": 0, "failures": []}
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/live", "/ready"}
    for op in operations:
        modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE] \
            if op.method.upper() == "POST" else [schemathesis.GenerationMode.POSITIVE]
        for mode in modes:
            @hypothesis.seed(1234)
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                      suppress_health_check=list(HealthCheck))
            @hypothesis.given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                tally["cases"] += 1
                try:
                    case.call_and_validate(checks=CHECKS)
                except (AssertionError, BaseExceptionGroup) as exc:  # Failure / FailureGroup
                    tally["failures"].append(f"{op.method.upper()} {op.path} [{mode.value}]: {str(exc)[:400]}")

            try:
                run()
            except hypothesis.errors.Unsatisfiable:
                pass
    print(f"schemathesis: {tally['cases']} cases, {len(tally['failures'])} failures")
    assert tally["failures"] == [], "\n".join(tally["failures"][:5])
    assert tally["cases"] >= 4 * EXAMPLES
    assert app.engine.block_manager.num_free == app.engine.block_manager.num_blocks
