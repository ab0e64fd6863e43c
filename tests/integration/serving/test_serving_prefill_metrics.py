"""The prefill worker's Prometheus series after real transfers over gRPC, its /metrics
endpoint behind the worker token, and the CLI's checks of --metrics-port."""

import re

import httpx
import pytest

from scd_serve.config.prefill import PrefillConfig
from scd_serve.errors import ConfigError
from scd_serve.prefill.metrics import metrics_app

from serving_helpers import engine_for, greedy, make_decode, prompts, settled, start_prefill


def value(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert m, f"{series} not in the scrape"
    return float(m.group(1))


@pytest.mark.timeout(60)
async def test_transfers_tokens_bytes_and_cache_are_counted(rt):
    node = await start_prefill(rt)
    peers, fill = await make_decode(rt, [node.address])
    engine = engine_for(rt, prefix_caching=False)  # the second is the producer code cache's to serve
    try:
        p = prompts(1)[0]
        for i in range(2):  # the second is a cache hit
            await greedy(engine, f"r{i}", p, "identity", fill)
        assert await settled(node, 2)
        app = metrics_app(node.servicer.metrics, token="s3cret")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as http:
            assert (await http.get("/metrics")).status_code == 401
            assert (await http.get("/metrics", headers={"Authorization": "Bearer wrong"})).status_code == 401
            r = await http.get("/metrics", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        text = r.text
        assert value(text, 'scd_prefill_transfers_total{method="identity",outcome="served"}') == 2
        assert value(text, 'scd_prefill_prompt_tokens_total{method="identity"}') == 2 * (len(p) - 1)
        assert value(text, 'scd_prefill_sent_bytes_total{method="identity"}') >= fill.stats.payload_bytes
        assert value(text, 'scd_prefill_transfer_seconds_count{cache="miss",method="identity"}') == 1
        assert value(text, 'scd_prefill_transfer_seconds_count{cache="hit",method="identity"}') == 1
        assert value(text, "scd_prefill_cache_hits_total") == 1 and value(text, "scd_prefill_running") == 0
        assert value(text, "scd_prefill_capacity") == node.servicer.config.max_concurrent
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await node.stop()


def test_metrics_port_is_checked():
    with pytest.raises(ConfigError, match="metrics_port must be in"):
        PrefillConfig(metrics_port=70000)
    with pytest.raises(ConfigError, match="must differ from the gRPC port"):
        PrefillConfig(port=9000, metrics_port=9000)


def test_an_open_metrics_port_beyond_loopback_needs_the_worker_token_or_insecure():
    from scd_serve.cli import build_parser
    from scd_serve.prefill.main import check_exposure, config_from_args
    from scd_serve.config.control import control_config_from_args

    args = build_parser("prefill").parse_args(["prefill", "--host", "0.0.0.0", "--metrics-port", "9400", "--worker-token", ""])
    with pytest.raises(ConfigError, match="metrics HTTP on 0.0.0.0 has no authentication"):
        check_exposure(config_from_args(args), control_config_from_args(args), insecure=False)
