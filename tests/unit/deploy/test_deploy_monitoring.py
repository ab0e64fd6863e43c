"""The monitoring profile: the dashboard queries only series the worker and gateway export,
Prometheus scrapes what compose runs, and the Grafana provisioning finds its files."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import yaml
from asgi_lifespan import LifespanManager

from scd_serve.api.app import create_app
from scd_serve.config.api import ApiConfig
from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.registry import Registry
from scd_serve.gateway.app import create_gateway_app

ROOT = Path(__file__).resolve().parents[3]
MONITORING = ROOT / "deploy" / "monitoring"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DASHBOARD = json.loads((MONITORING / "grafana" / "dashboards" / "scd-serve.json").read_text())
sys.path.insert(0, str(ROOT / "tests" / "unit" / "api"))
from api_fakes import FakeBackend  # noqa: E402

SERIES = re.compile(r"\b((?:vllm:|scd_)[a-z_:]+?)(?:_bucket|_sum|_count)?\b")


def queried_series() -> set[str]:
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in DASHBOARD["templating"]["list"] if "definition" in v]
    return {m.group(1) for e in exprs for m in SERIES.finditer(e)}


def exported_series(text: str) -> set[str]:
    """Series names in an exposition, as PromQL names them (a histogram by its base name)."""
    return {m.group(1) for line in text.splitlines() if line.startswith("# HELP ")
            for m in [SERIES.match(line.split()[2])] if m}


async def test_dashboard_queries_only_exported_series():
    worker = create_app(ApiConfig(max_model_len=256, max_tokens_cap=64), FakeBackend())
    gateway = create_gateway_app(GatewayConfig(port=0), Registry(ttl_s=30))
    exported = set()
    for app in (worker, gateway):
        async with LifespanManager(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                           base_url="http://t") as c:
            exported |= exported_series((await c.get("/metrics")).text)
    queried = queried_series()
    assert {"vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc",
            "scd_gateway_time_to_first_token_seconds"} <= queried
    assert queried <= exported, f"the dashboard queries series nobody exports: {sorted(queried - exported)}"


def test_prometheus_scrapes_the_compose_services_on_their_ports():
    """Every role and its GPU variant, on the port its command serves /metrics on, with the
    credential that port asks for: the API key on HTTP APIs, the worker token on prefill's."""
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    services = COMPOSE["services"]
    targets = []
    for job in config["scrape_configs"]:
        prefill = job["job_name"] == "scd-prefill"
        want = "/tmp/worker-token" if prefill else "/tmp/api-key"
        assert job["authorization"]["credentials_file"] == want, job["job_name"]
        targets += [(t, prefill) for sc in job.get("static_configs", []) for t in sc["targets"]]
        targets += [(f"{n}:{sd['port']}", prefill) for sd in job.get("dns_sd_configs", []) for n in sd["names"]]
    assert sorted(t for t, _ in targets) == ["decode-gpu:8001", "decode:8001", "gateway:8000", "prefill-gpu:9400",
                                             "prefill:9400"]
    for target, prefill in targets:
        name, port = target.split(":")
        assert services[name].get("profiles", ["gpu"]) == ["gpu"]  # a role, or its GPU variant
        assert (f"--metrics-port {port}" if prefill else f"--port {port}") in services[name]["command"][0]
    prometheus = " ".join(services["prometheus"]["command"])
    assert "/tmp/api-key" in prometheus and "/tmp/worker-token" in prometheus


def test_monitoring_profile_is_opt_in_loopback_only_and_mounts_what_exists():
    monitoring = {n: s for n, s in COMPOSE["services"].items() if "monitoring" in s.get("profiles", [])}
    assert set(monitoring) == {"prometheus", "grafana"}
    for name, svc in monitoring.items():
        assert svc["profiles"] == ["monitoring"], name
        assert all(str(p).startswith("127.0.0.1:") for p in svc["ports"]), name
        for volume in svc["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"
    assert "credentials_file" not in COMPOSE["services"]["prometheus"]["command"][0]  # the key comes from the volume
    provisioned = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/scd-serve.yml").read_text())
    assert provisioned["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_k8s_monitoring_overlay_scrapes_gateway_and_every_decode_pod_with_the_key():
    from test_deploy_k8s import K8S_VERSION, render

    import kubernetes_validate

    objects = render(ROOT / "deploy" / "k8s-monitoring")
    monitors = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceMonitor"}
    assert set(monitors) == {"scd-serve", "scd-serve-prefill"}
    monitor = monitors["scd-serve"]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    selector = monitor["spec"]["selector"]
    (expr,) = selector["matchExpressions"]

    def selected(svc: dict) -> bool:
        labels = svc["metadata"]["labels"]
        return (all(labels.get(k) == v for k, v in selector["matchLabels"].items())
                and labels.get(expr["key"]) in expr["values"])

    assert sorted(n for n, s in services.items() if selected(s)) == ["decode", "gateway"]
    (endpoint,) = monitor["spec"]["endpoints"]
    for name in ("decode", "gateway"):
        assert endpoint["port"] in {p["name"] for p in services[name]["spec"]["ports"]}
    assert endpoint["authorization"]["credentials"] == {"name": "scd-serve-secrets", "key": "api-key"}
    (policy,) = [o for o in objects if o["metadata"]["name"] == "scd-serve-metrics-ingress"]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": endpoint["port"]}]
    # prefill workers: their own metrics port, behind the worker token, opened to monitoring alone
    prefill = monitors["scd-serve-prefill"]
    (endpoint,) = prefill["spec"]["endpoints"]
    assert endpoint["authorization"]["credentials"] == {"name": "scd-serve-secrets", "key": "worker-token"}
    assert endpoint["port"] in {p["name"] for p in services["prefill"]["spec"]["ports"]}
    (deploy,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "prefill"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == endpoint["port"])
    assert f"--metrics-port={port}" in container["args"]
    (policy,) = [o for o in objects if o["metadata"]["name"] == "scd-serve-prefill-metrics-ingress"]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": endpoint["port"]}]


def test_decode_scales_on_queue_depth_through_the_adapter_rule():
    from test_deploy_k8s import K8S_VERSION, render

    import kubernetes_validate

    objects = render(ROOT / "deploy" / "k8s-monitoring")
    (hpa,) = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler" and o["metadata"]["name"] == "decode"]
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    kinds = [m["type"] for m in hpa["spec"]["metrics"]]
    assert kinds == ["Resource", "Pods"]  # CPU as before, and the queue
    metric = hpa["spec"]["metrics"][1]["pods"]["metric"]["name"]
    rules = yaml.safe_load((ROOT / "deploy" / "k8s-monitoring" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = [r for r in rules["rules"]["custom"] if r["name"]["as"] == metric]
    series = rule["seriesQuery"].split("{")[0]
    assert series == "vllm:num_requests_waiting"  # a series every decode worker exports (api/metrics.py)
