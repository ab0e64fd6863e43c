"""Offline checks of the kustomize base in deploy/k8s: schema (kubernetes-validate, strict)
and the references between objects that a schema cannot see. No cluster needed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
K8S_MTLS = ROOT / "deploy" / "k8s-mtls"
K8S_GPU = ROOT / "deploy" / "k8s-gpu"
K8S_MONITORING = ROOT / "deploy" / "k8s-monitoring"
K8S_MODELS = ROOT / "deploy" / "k8s-models"
K8S_VERSION = "1.37.0"
# The kustomization fields this renderer applies; anything else must fail loudly, not be skipped.
KNOWN_KUSTOMIZE_KEYS = {"apiVersion", "kind", "labels", "resources", "patches"}


def render(root: Path = K8S) -> list[dict]:
    """The objects `kustomize build ROOT` produces, for the fields these kustomizations use:
    resources (files, or a directory = its own kustomization), labels (metadata only), and
    patches given as JSON 6902 operations (add, replace) on a target kind + name."""
    kust = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(kust) - KNOWN_KUSTOMIZE_KEYS
    assert not unknown, f"renderer does not apply kustomization fields {unknown}"
    objs = []
    for name in kust["resources"]:
        if (root / name).is_dir():
            objs += render((root / name).resolve())
            continue
        for doc in yaml.safe_load_all((root / name).read_text()):
            if doc is None:
                continue
            for entry in kust.get("labels", []):
                assert not entry.get("includeSelectors"), "renderer applies metadata labels only"
                doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
            objs.append(doc)
    for patch in kust.get("patches", []):
        target = patch["target"]
        (obj,) = [o for o in objs if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        for op in yaml.safe_load((root / patch["path"]).read_text()):
            json_patch(obj, op)
    return objs


def json_patch(obj: dict, op: dict) -> None:
    """One RFC 6902 add or replace (the operations the overlays use)."""
    *parents, last = [k.replace("~1", "/").replace("~0", "~") for k in op["path"].lstrip("/").split("/")]
    node = obj
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if op["op"] == "add" and isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), op["value"])
    elif op["op"] in ("add", "replace"):
        if op["op"] == "replace":
            present = int(last) < len(node) if isinstance(node, list) else last in node
            assert present, f"replace of a missing {op['path']}"
        node[int(last) if isinstance(node, list) else last] = op["value"]
    else:
        raise AssertionError(f"renderer does not apply op {op['op']}")


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
    gateway = deployments["gateway"]["spec"]
    assert gateway["replicas"] == 2 and gateway["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    # every worker heartbeats every gateway: the control URL names a headless Service that lists
    # not-ready pods too (a new gateway is ready only once workers found it)
    (config,) = [o for o in OBJECTS if o["kind"] == "ConfigMap"]
    control = by_kind("Service")[config["data"]["SCD_CONTROL_URL"].split("//")[1].split(":")[0]]["spec"]
    assert control["clusterIP"] == "None" and control["publishNotReadyAddresses"] is True
    assert control["selector"] == deployments["gateway"]["spec"]["selector"]["matchLabels"]
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


def pod_templates(objects: list[dict]) -> dict[str, dict]:
    """name -> pod spec of every Deployment and Job."""
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Deployment", "Job")}


def check_references(objects: list[dict]) -> None:
    """Claims, volumes, ConfigMaps and $(VAR)s that the pod specs use all exist."""
    claims = {o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolumeClaim"}
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    for name, spec in pod_templates(objects).items():
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, name
        for c in spec["containers"] + spec.get("initContainers", []):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{name} mounts unknown volume {m['name']}"
            defined = {e["name"] for e in c.get("env", [])}
            for src in c.get("envFrom", []):
                defined |= set(configmaps[src["configMapRef"]["name"]]["data"])
            for arg in c.get("args", []):
                for var in re.findall(r"\$\((\w+)\)", arg):
                    assert var in defined, f"{name}: args use $({var}) but no env defines it"


def test_volumes_and_config_references_resolve_and_the_base_needs_no_claim():
    check_references(OBJECTS)
    assert not by_kind("PersistentVolumeClaim"), "the base must start on any cluster: no claim"
    for role, spec in pod_specs().items():
        assert all("persistentVolumeClaim" not in v for v in spec.get("volumes", [])), role


def restricted_violations(spec: dict) -> list[str]:
    """The Pod Security Standards' "restricted" level (kubernetes.io/docs/concepts/security/
    pod-security-standards), checked rule by rule on one pod spec; [] when it passes."""
    out = []
    pod_sc = spec.get("securityContext", {})
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= allowed_volumes:
            out.append(f"volume {v['name']}: {kinds - allowed_volumes}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(key)
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation must be false")
        if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True):
            out.append(f"{c['name']}: runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.append(f"{c['name']}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccompProfile {seccomp}")
        caps = sc.get("capabilities", {})
        if caps.get("drop") != ["ALL"] or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: capabilities must drop ALL")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{c['name']}: hostPort")
    return out


@pytest.mark.parametrize("root", [K8S, K8S_MTLS, K8S_GPU, K8S_MONITORING, K8S_MODELS],
                         ids=["base", "mtls", "gpu", "monitoring", "models"])
def test_every_pod_passes_the_restricted_pod_security_level_with_a_read_only_root(root):
    for name, spec in pod_templates(render(root)).items():
        assert restricted_violations(spec) == [], name
        assert spec["automountServiceAccountToken"] is False, name  # nothing here calls the API server
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, f"{name}/{c['name']}"
        if name != "scd-models-fill":  # writable scratch for every serving container
            mounts = {m["mountPath"]: m["name"] for c in spec["containers"] for m in c["volumeMounts"]}
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], name


def test_a_disruption_budget_per_role():
    budgets = by_kind("PodDisruptionBudget")
    for role in ("gateway", "prefill", "decode"):
        labels = pod_specs_labels()[role]
        hits = [b for b in budgets.values() if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(hits) == 1 and hits[0]["spec"]["maxUnavailable"] == 1, role


def test_models_overlay_fills_a_claim_and_workers_wait_then_mount_it_read_only():
    objects = render(K8S_MODELS)
    check_references(objects)
    specs = pod_templates(objects)
    (claim,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]  # what kind/minikube/k3s provisioners offer
    job = specs["scd-models-fill"]
    assert {m["mountPath"]: m.get("readOnly", False) for m in job["containers"][0]["volumeMounts"]}["/models/user"] is False
    (config,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "scd-serve"]
    assert config["data"]["SCD_PRODUCER"] == "/models/user/producer"
    assert config["data"]["SCD_CONSUMER"] == "/models/user/consumer"
    for role in ("prefill", "decode"):
        spec = specs[role]
        (init,) = spec["initContainers"]
        assert ".complete" in init["args"][0] and ".complete" in job["containers"][0]["args"][0]
        mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["/models/user"]["readOnly"] is True
        compile(init["args"][0], "wait-for-models", "exec")  # the inline scripts are valid Python
    compile(job["containers"][0]["args"][0], "fill", "exec")
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


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


# ---- secure by default: secrets from a Secret, NetworkPolicy, mTLS overlay ----------------------

SECRET_KEYS = {"gateway": {"SCD_CLUSTER_SECRET": "cluster-secret", "SCD_API_KEY": "api-key"},
               "prefill": {"SCD_CLUSTER_SECRET": "cluster-secret", "SCD_WORKER_TOKEN": "worker-token"},
               "decode": {"SCD_CLUSTER_SECRET": "cluster-secret", "SCD_API_KEY": "api-key",
                          "SCD_WORKER_TOKEN": "worker-token"}}
MTLS_OBJECTS = render(K8S_MTLS)


def secret_env(role: str, objects=None) -> dict[str, tuple[str, str]]:
    objects = objects or OBJECTS
    (d,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == role]
    (c,) = d["spec"]["template"]["spec"]["containers"]
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}


@pytest.mark.parametrize("role", ["gateway", "prefill", "decode"])
def test_secrets_come_from_the_secret(role):
    assert secret_env(role) == {var: ("scd-serve-secrets", key) for var, key in SECRET_KEYS[role].items()}
    assert "Secret" not in {o["kind"] for o in OBJECTS}, "no secret value is committed"
    for o in by_kind("ConfigMap").values():
        assert not {"SCD_API_KEY", "SCD_WORKER_TOKEN", "SCD_CLUSTER_SECRET"} & set(o["data"])


@pytest.mark.parametrize("role", ["gateway", "prefill", "decode"])
def test_args_pass_the_open_bind_check_only_with_the_secret(role, monkeypatch):
    import importlib

    from scd_serve.cli import COMMANDS, build_parser
    from scd_serve.config.control import control_config_from_args
    from scd_serve.errors import ConfigError

    module = importlib.import_module(COMMANDS[role][0])

    def check(env: dict[str, str]) -> None:
        for var in ("SCD_API_KEY", "SCD_WORKER_TOKEN", "SCD_CLUSTER_SECRET"):
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        args = build_parser(only=role).parse_args(expanded_args(role))
        config, control = module.config_from_args(args), control_config_from_args(args)
        module.check_exposure(config, control, args.insecure)

    check({var: f"from-the-secret-{key}-0123456789" for var, key in SECRET_KEYS[role].items()})
    with pytest.raises(ConfigError, match="--insecure"):
        check({})


def _selects(selector: dict, role: str) -> bool:
    labels = pod_specs_labels()[role]
    return selector.get("matchLabels", {}).items() <= labels.items()


def pod_specs_labels() -> dict[str, dict]:
    return {name: d["spec"]["template"]["metadata"]["labels"] for name, d in by_kind("Deployment").items()}


def allowed(to: str) -> set[tuple[str, str]]:
    """(from, port name) pairs the NetworkPolicies admit into pods of role `to`; ("*", port)
    for any source. Policies are additive; a pod selected by any policy denies the rest."""
    pols = [p for p in by_kind("NetworkPolicy").values() if _selects(p["spec"]["podSelector"], to)]
    assert pols, f"no NetworkPolicy selects {to}: everything could reach it"
    out = set()
    for p in pols:
        assert p["spec"]["policyTypes"] == ["Ingress"]
        for rule in p["spec"].get("ingress", []):
            ports = [q["port"] for q in rule["ports"]]
            roles = ("gateway", "prefill", "decode")
            sources = ["*"] if "from" not in rule else [
                r for peer in rule["from"] for r in roles if _selects(peer["podSelector"], r)]
            assert all(set(peer) == {"podSelector"} for peer in rule.get("from", [])), "pods of this app only"
            out |= {(s, q) for s in sources for q in ports}
    return out


def test_network_policy_only_the_gateway_reaches_decode_only_decode_reaches_prefill():
    assert allowed("decode") == {("gateway", "http")}
    assert allowed("prefill") == {("decode", "grpc")}
    assert allowed("gateway") == {("*", "http"), ("decode", "control"), ("prefill", "control")}
    deny = by_kind("NetworkPolicy")["scd-serve-default-deny"]["spec"]
    assert deny["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "scd-serve"} and "ingress" not in deny
    for role, spec in pod_specs().items():  # every named port in a policy exists on the pod it protects
        names = {p["name"] for c in spec["containers"] for p in c["ports"]}
        assert {port for _, port in allowed(role)} <= names, role


@pytest.mark.parametrize("obj", MTLS_OBJECTS, ids=lambda o: f"mtls-{o['kind']}/{o['metadata']['name']}")
def test_mtls_overlay_matches_schema_strictly(obj):
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_mtls_overlay_wires_certificates_and_probes():
    from scd_serve.cli import build_parser

    deployments = {o["metadata"]["name"]: o for o in MTLS_OBJECTS if o["kind"] == "Deployment"}
    base = {o["metadata"]["name"]: o for o in OBJECTS if o["kind"] == "Deployment"}
    for role, files in (("prefill", ("prefill.pem", "prefill-key.pem")), ("decode", ("decode.pem", "decode-key.pem"))):
        spec = deployments[role]["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        args = build_parser(only=role).parse_args(
            [re.sub(r"\$\((\w+)\)", "x", a) for a in c["args"]])
        assert (args.tls_cert, args.tls_key, args.tls_ca) == (f"/etc/scd/tls/{files[0]}", f"/etc/scd/tls/{files[1]}",
                                                             "/etc/scd/tls/ca.pem")
        (vol,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        assert vol["secret"]["secretName"] == "scd-serve-tls"
        assert {i["key"] for i in vol["secret"]["items"]} == {"ca.pem", *files}, "no other role's key"
        assert {"name": "tls", "mountPath": "/etc/scd/tls", "readOnly": True} in c["volumeMounts"]
        if role == "decode":
            assert args.tls_server_name == "prefill"
        else:  # the kubelet's grpc probe speaks no TLS: the image's health check, which reads PID 1's flags
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert c[kind]["exec"]["command"] == ["python", "/opt/scd/healthcheck.py"] and "grpc" not in c[kind]
    # everything else is the base
    assert deployments["gateway"] == base["gateway"]
    assert len(MTLS_OBJECTS) == len(OBJECTS)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to compare with")
@pytest.mark.parametrize("root", [K8S, K8S_MTLS, K8S_GPU, K8S_MONITORING, K8S_MODELS],
                         ids=["base", "mtls", "gpu", "monitoring", "models"])
def test_renderer_agrees_with_kustomize(root):
    out = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    real = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out.stdout)}
    mine = {(o["kind"], o["metadata"]["name"]): o for o in render(root)}
    assert real == mine


def test_k8s_secrets_script_creates_both_secrets_once(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl")
    log = tmp_path / "kubectl.log"
    fake = tmp_path / "kubectl"
    # a kubectl that knows no secret yet, records each call, and keeps the files it is given
    fake.write_text(f"""#!/bin/sh
echo "$@" >> {log}
case "$1" in get) exit 1 ;; esac
for a in "$@"; do case "$a" in --from-file=*) ls "${{a#--from-file=}}" >> {log} ;; esac; done
""")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    r = subprocess.run(["sh", str(ROOT / "deploy/scripts/k8s-secrets.sh"), "--mtls", "-n", "ml"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text()
    (create,) = [ln for ln in calls.splitlines() if "scd-serve-secrets" in ln and ln.startswith("create")]
    values = dict(re.findall(r"--from-literal=([\w-]+)=(\w+)", create))
    assert set(values) == {"cluster-secret", "api-key", "worker-token"} and "--namespace=ml" in create
    assert all(len(v) == 64 for v in values.values()) and len(set(values.values())) == 3
    assert "create secret generic --namespace=ml scd-serve-tls" in calls
    for name in ("ca.pem", "prefill.pem", "prefill-key.pem", "decode.pem", "decode-key.pem"):
        assert f"\n{name}\n" in calls
    assert "ca-key.pem" not in calls


GPU_OBJECTS = render(K8S_GPU)


@pytest.mark.parametrize("obj", GPU_OBJECTS, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_gpu_overlay_matches_schema_strictly(obj):
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_gpu_overlay_puts_workers_on_a_gpu_with_cuda_and_bfloat16():
    base = by_kind("Deployment")
    gpu = {o["metadata"]["name"]: o for o in GPU_OBJECTS if o["kind"] == "Deployment"}
    for role in ("prefill", "decode"):
        (c,) = gpu[role]["spec"]["template"]["spec"]["containers"]
        assert c["image"] == "scd-serve:cuda" and c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "--device=cuda" in c["args"] and "--device=cpu" not in c["args"], c["args"]
        assert "--dtype=bfloat16" in c["args"]
        (b,) = base[role]["spec"]["template"]["spec"]["containers"]
        changed = {a for a in c["args"]} ^ {a for a in b["args"]}
        assert changed == {"--device=cpu", "--device=cuda", "--dtype=bfloat16"}, changed  # the patch hit --device
    assert gpu["gateway"] == base["gateway"]
