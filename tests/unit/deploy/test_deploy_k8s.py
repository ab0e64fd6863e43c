"""Offline checks of the kustomize base in deploy/k8s: schema (kubernetes-validate, strict)
and the references between objects that a schema cannot see. No cluster needed."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.37.0"
# The kustomization fields this renderer applies; anything else must fail loudly, not be skipped.
KNOWN_KUSTOMIZE_KEYS = {"apiVersion", "kind", "labels", "resources"}


def render() -> list[dict]:
    """The objects `kustomize build deploy/k8s` produces, for the fields this base uses."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    unknown = set(kust) - KNOWN_KUSTOMIZE_KEYS
    assert not unknown, f"renderer does not apply kustomization fields {unknown}"
    objs = []
    for name in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc is None:
                continue
            for entry in kust.get("labels", []):
                assert not entry.get("includeSelectors"), "renderer applies metadata labels only"
                doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
            objs.append(doc)
    return objs


OBJECTS = render()


def by_kind(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in OBJECTS if o["kind"] == kind}


def pod_specs() -> dict[str, dict]:
    return {name: d["spec"]["template"]["spec"] for name, d in by_kind("Deployment").items()}


@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_object_matches_schema_strictly(obj):
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_manifest_file_is_listed():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == listed


def test_roles_and_autoscalers():
    deployments = by_kind("Deployment")
    assert set(deployments) == {"gateway", "prefill", "decode"}
    assert deployments["gateway"]["spec"]["replicas"] == 1  # one registry for all workers
    hpas = by_kind("HorizontalPodAutoscaler")
    targets = {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()}
    assert targets == {"prefill", "decode"}
    for hpa in hpas.values():
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def test_selectors_match_templates_and_services_hit_one_deployment():
    deployments = by_kind("Deployment")
    for name, d in deployments.items():
        selector = d["spec"]["selector"]["matchLabels"]
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), name
    for name, svc in by_kind("Service").items():
        sel = svc["spec"]["selector"].items()
        hits = [d for d in deployments.values() if sel <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(hits) == 1, f"service {name} selects {len(hits)} deployments"
        port_names = {p["name"] for c in hits[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"service {name}: no container port {port['targetPort']}"


def _probe_port(probe: dict, ports: dict[str, int]) -> int:
    handler = probe.get("httpGet") or probe.get("grpc") or probe.get("tcpSocket")
    port = handler["port"]
    return ports[port] if isinstance(port, str) else port


@pytest.mark.parametrize("role", ["gateway", "prefill", "decode"])
def test_probes_resources_and_security(role):
    spec = pod_specs()[role]
    assert spec["securityContext"]["runAsNonRoot"] is True
    for c in spec["containers"]:
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert {"cpu", "memory"} <= set(c["resources"]["requests"])
        for kind in ("livenessProbe", "readinessProbe"):
            probe = c[kind]
            assert _probe_port(probe, ports) in ports.values(), f"{role} {kind} probes an unserved port"
            if role == "prefill":
                assert "grpc" in probe, "prefill health is grpc.health.v1"
            else:
                expected = "/live" if kind == "livenessProbe" else "/ready"
                assert probe["httpGet"]["path"] == expected


def test_runs_as_the_image_user():
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    uid = int(re.search(r"useradd .*--uid (\d+)", dockerfile).group(1))
    for role, spec in pod_specs().items():
        assert spec["securityContext"]["runAsUser"] == uid, role


def test_volumes_claims_and_config_references_resolve():
    claims = set(by_kind("PersistentVolumeClaim"))
    configmaps = by_kind("ConfigMap")
    for role, spec in pod_specs().items():
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{role} mounts unknown volume {m['name']}"
            defined = {e["name"] for e in c.get("env", [])}
            for src in c.get("envFrom", []):
                defined |= set(configmaps[src["configMapRef"]["name"]]["data"])
            for arg in c.get("args", []):
                for var in re.findall(r"\$\((\w+)\)", arg):
                    assert var in defined, f"{role}: args use $({var}) but no env defines it"
    for role in ("prefill", "decode"):
        mounts = [m for c in pod_specs()[role]["containers"] for m in c.get("volumeMounts", [])]
        assert any(m["readOnly"] for m in mounts), f"{role} has no read-only models volume"


def expanded_args(role: str) -> list[str]:
    """The container's args with $(VAR) replaced the way the kubelet does it."""
    (c,) = pod_specs()[role]["containers"]
    values = {"POD_IP": "10.0.0.7"}
    for src in c.get("envFrom", []):
        values.update(by_kind("ConfigMap")[src["configMapRef"]["name"]]["data"])
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in c["args"]]


@pytest.mark.parametrize("role", ["gateway", "prefill", "decode"])
def test_args_parse_with_the_real_cli(role):
    cli = pytest.importorskip("scd_serve.cli")
    module = cli.COMMANDS[role][0]
    pytest.importorskip(module, reason=f"{module} has not landed yet")
    args = cli.build_parser(only=role).parse_args(expanded_args(role))
    assert args.command == role
    if role != "gateway":
        assert args.advertise == ("10.0.0.7:50051" if role == "prefill" else "10.0.0.7:8001")
