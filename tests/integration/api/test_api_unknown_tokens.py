"""A prompt the model cannot read is answered with a warning, not silently: the embedded demo
pair speaks a made-up word-level language, so "hello, who are you?" is <bos> and four <unk>.
Real engine on the demo pair's consumer, real server, the official openai client; through the
gateway too (it forwards the header)."""

import logging
from pathlib import Path

import openai
import pytest
from api_server import ServerThread, engine_app, stop_engine

from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.registry import Registry
from scd_serve.gateway.app import create_gateway_app
from scd_serve.model import ModelRuntime

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
DEMO_CONSUMER = Path(__file__).resolve().parents[3] / "models" / "demo-pair" / "consumer"


@pytest.fixture(scope="module")
def urls():
    app, engine = engine_app(ModelRuntime.load(DEMO_CONSUMER))
    with ServerThread(app) as worker:
        gateway = create_gateway_app(GatewayConfig(port=0, decode=(worker.url.removeprefix("http://"),)),
                                     Registry(ttl_s=30))
        with ServerThread(gateway) as gw:
            yield worker.url, gw.url
    stop_engine(engine)


@pytest.mark.parametrize("where", [0, 1], ids=["worker", "gateway"])
def test_a_prompt_of_mostly_unknown_tokens_gets_a_header_and_a_log_line(urls, where, caplog):
    client = openai.OpenAI(base_url=urls[where] + "/v1", api_key="unused", max_retries=0, timeout=30)
    with caplog.at_level(logging.WARNING, logger="scd_serve.api"):
        raw = client.completions.with_raw_response.create(model="tiny-llama", prompt="hello, who are you?",
                                                          max_tokens=2, temperature=0)
    warning = raw.headers.get("x-scd-warning", "")
    assert warning.startswith("4 of 4 prompt tokens are unknown") and "<unk>" in warning, warning
    assert raw.parse().choices[0].finish_reason == "length"  # still answered
    logged = [r.getMessage() for r in caplog.records if "unknown to this model's vocabulary" in r.getMessage()]
    assert logged and "hello" not in logged[0]  # counts, never the prompt's text
    stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hello there"}],
                                            max_tokens=2, temperature=0, stream=True)
    assert "unknown" in stream.response.headers["x-scd-warning"]
    list(stream)


def test_a_prompt_in_the_pairs_language_has_no_warning(urls):
    client = openai.OpenAI(base_url=urls[1] + "/v1", api_key="unused", max_retries=0, timeout=30)
    raw = client.completions.with_raw_response.create(model="tiny-llama", prompt="records tower dark harbor ;",
                                                      max_tokens=2, temperature=0)
    assert "x-scd-warning" not in raw.headers
