"""The compose `monitoring` profile with a real Prometheus: it scrapes the gateway, the decode
worker and the prefill worker's metrics port with the credentials the profile hands it, and
every query of the shipped Grafana dashboard (deploy/monitoring/grafana/dashboards) answers
with data after traffic through the published port.

No registry is reachable here, so Prometheus is Debian's package in an image that
deploy/scripts/ci-docker.sh builds (SCD_PROMETHEUS_IMAGE points the profile at it; users get
prom/prometheus). Grafana has no Debian package: its container is not started, and the
dashboard's queries (its template variable resolved as "All") go to Prometheus's HTTP API,
which is what Grafana would send.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid

import httpx
import pytest

from compose_cluster import ROOT, UP_TIMEOUT_S, Cluster, free_port, openai_client, require_engine

PROMETHEUS_IMAGE = os.environ.get("SCD_TEST_PROMETHEUS_IMAGE", "scd-prometheus:bookworm")
DASHBOARD = ROOT / "deploy" / "monitoring" / "grafana" / "dashboards" / "scd-serve.json"
JOBS = {"scd-gateway", "scd-decode", "scd-prefill"}
SCRAPE_WAIT_S = 90  # a few 5 s scrape intervals, and DNS refreshes (10 s), on a loaded machine
PROMPTS = ["The capital of France is", "Water boils at", "One plus one equals", "The sky is"]
# Panels that must show a number after the traffic below, not only a series (a rate over
# counters that moved, a quantile over histograms that were observed).
MUST_HAVE_VALUES = ("vllm:time_to_first_token_seconds", "scd_gateway_time_to_first_token_seconds",
                    "vllm:generation_tokens_total", "scd_transfer_bytes_total")

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(UP_TIMEOUT_S + 300)]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, with Grafana's variables filled in."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$model_name", ".*").replace("$__rate_interval", "5m")
            out.append((panel["title"], expr))
    return out


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", f"{expr}: {r.status_code} {r.text[:300]}"
    return r.json()["data"]["result"]


def wait_for(what: str, check, deadline_s: float = SCRAPE_WAIT_S):
    deadline, last = time.monotonic() + deadline_s, None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(2)
    raise AssertionError(f"{what} not seen within {deadline_s:.0f} s (last: {last!r})")


def test_prometheus_scrapes_every_worker_and_every_dashboard_query_answers():
    require_engine(PROMETHEUS_IMAGE)
    prom_port = free_port()
    c = Cluster(project=f"scd-e2e-mon-{uuid.uuid4().hex[:8]}", port=free_port(),
                extra_env={"COMPOSE_PROFILES": "monitoring", "SCD_PROMETHEUS_IMAGE": PROMETHEUS_IMAGE,
                           "SCD_PROMETHEUS_PORT": str(prom_port)})
    prom = f"http://127.0.0.1:{prom_port}"
    try:
        c.up("gateway", "prefill", "decode", "prometheus")
        c.read_api_key()

        def targets():
            active = httpx.get(f"{prom}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            health = {(t["labels"]["job"], t["health"]) for t in active}
            return health if {job for job, h in health if h == "up"} == JOBS else None

        health = wait_for("every scrape job up", targets)
        assert all(h == "up" for _, h in health), health

        oc = openai_client(c)
        model = oc.models.list().data[0].id

        def complete(prompt: str) -> None:  # streamed: the gateway times the first event
            stream = oc.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                           extra_body={"scd_method": "scd"})
            assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) is not None

        # The histograms exist in Prometheus before the rest of the traffic, so rates see them move.
        complete(PROMPTS[0])
        # from the decode worker itself: the gateway exports vllm:* too, and a sample of the gateway's
        # alone let all the traffic fall between two scrapes of the worker (its rates then stay 0)
        for counted in ('vllm:time_to_first_token_seconds_count{job="scd-decode"}',
                        'scd_transfer_bytes_total{job="scd-decode"}', "scd_gateway_time_to_first_token_seconds_count"):
            wait_for(f"{counted} scraped", lambda: query(prom, counted))
        for prompt in PROMPTS[1:]:
            complete(prompt)

        series = httpx.get(f"{prom}/api/v1/series", params={"match[]": "vllm:num_requests_running"},
                           timeout=10).json()["data"]
        assert {s.get("model_name") for s in series} == {model}, series  # the dashboard's Model variable

        queries = dashboard_queries()
        assert len(queries) >= 20
        for title, expr in queries:  # each within a few scrapes of the traffic
            need_value = any(name in expr for name in MUST_HAVE_VALUES)

            def answered():
                result = query(prom, expr)
                values = [float(r["value"][1]) for r in result]
                return result if result and (not need_value or any(math.isfinite(v) and v > 0 for v in values)) \
                    else None

            wait_for(f"panel {title!r}: {expr} answering{' with a number' if need_value else ''}", answered)
    except BaseException:
        print(f"monitoring cluster logs in {c.save_logs()}")
        raise
    finally:
        c.down()
