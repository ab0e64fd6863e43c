"""Offline checks of docker-compose.yml and the image's health check (no Docker needed).
The real thing runs in tests/e2e/docker/test_compose.py."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
# the three roles; the one-shot `secrets` service is checked below, the `monitoring` profile's
# services in test_deploy_monitoring.py
SERVICES = {name: svc for name, svc in COMPOSE["services"].items() if "profiles" not in svc and name != "secrets"}
OVERRIDABLE = ("SCD_PRODUCER", "SCD_CONSUMER", "SCD_CODEBOOK", "SCD_METHOD", "SCD_MODELS_DIR")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ${VAR:-default}, ${VAR}, and $$ for a literal $."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, default = m.group(1), m.group(3)
        return env.get(name) or (default if default is not None else "")
    return re.sub(r"\$\$|\$\{(\w+)(:-([^}]*))?\}", sub, text)


def worker_argv(service: str, env: dict[str, str], container_env: dict[str, str] | None = None) -> list[str]:
    """The scd-serve argv a container runs: compose-interpolated, then split like sh would,
    with the container-address substitution replaced by an example IP. container_env: what
    the entrypoint adds to the container's environment (with_secrets.py: SCD_TLS_DIR)."""
    (script,) = SERVICES[service]["command"]
    script = interpolate(script, env)
    inside = {k: interpolate(str(v), env) for k, v in SERVICES[service].get("environment", {}).items()}
    inside.update(container_env or {})
    # sh's ${VAR:+WORD}: WORD (with $VAR expanded) when the container has VAR set and non-empty
    script = re.sub(r"\$\{(\w+):\+([^}]*)\}",
                    lambda m: m.group(2).replace("$" + m.group(1), inside[m.group(1)]) if inside.get(m.group(1)) else "",
                    script)
    script = script.replace("$(hostname -i | cut -d' ' -f1)", "172.18.0.5")
    argv = shlex.split(script)
    assert argv[:2] == ["exec", "scd-serve"], script
    return argv[2:]


def test_three_roles_one_image():
    assert set(SERVICES) == {"gateway", "prefill", "decode"}
    images = {s["image"] for s in SERVICES.values()}
    assert len(images) == 1


def test_only_the_gateway_is_published_and_only_on_loopback():
    for name, svc in SERVICES.items():
        ports = svc.get("ports", [])
        if name != "gateway":
            assert not ports, f"{name} publishes a host port, so --scale would clash"
        for p in ports:
            assert str(p).startswith("127.0.0.1:"), f"{name} publishes {p} beyond loopback"
    assert len(SERVICES["gateway"]["ports"]) == 1


def test_scalable_without_edits():
    for name, svc in SERVICES.items():
        assert "container_name" not in svc, f"{name} has a fixed container_name"
    for role in ("prefill", "decode"):
        advertise = worker_argv(role, {})[worker_argv(role, {}).index("--advertise") + 1]
        assert advertise.startswith("172.18.0.5:"), "a replica must advertise its own address"


def test_health_restart_and_start_order():
    for name, svc in SERVICES.items():
        assert svc["healthcheck"]["test"], name
        assert svc["restart"] in ("always", "unless-stopped", "on-failure"), name
    conditions = [c["condition"] for s in SERVICES.values() for c in s.get("depends_on", {}).values()]
    assert "service_healthy" in conditions
    for name, svc in SERVICES.items():  # every role starts after the secrets exist
        assert svc["depends_on"]["secrets"] == {"condition": "service_completed_successfully"}, name
    # no cycle: a topological order exists
    deps = {n: set(s.get("depends_on", {})) for n, s in SERVICES.items()}
    order: list[str] = ["secrets"]
    while deps:
        free = [n for n, d in deps.items() if d <= set(order)]
        assert free, f"depends_on cycle among {sorted(deps)}"
        order += free
        for n in free:
            del deps[n]


def test_models_and_method_are_overridable():
    env = {"SCD_PRODUCER": "/models/user/p", "SCD_CONSUMER": "/models/user/c",
           "SCD_CODEBOOK": "/models/user/cb", "SCD_METHOD": "raw"}
    prefill, decode = worker_argv("prefill", env), worker_argv("decode", env)
    assert prefill[prefill.index("--model") + 1] == "/models/user/p"
    assert decode[decode.index("--model") + 1] == "/models/user/c"
    assert decode[decode.index("--codebook") + 1] == "/models/user/cb"
    assert decode[decode.index("--method") + 1] == "raw"
    assert "--method" not in worker_argv("decode", {}), "unset: the worker picks scd or raw itself"
    mounts = [interpolate(v, {"SCD_MODELS_DIR": "/srv/m"}) for v in SERVICES["decode"]["volumes"]]
    assert "/srv/m:/models/user:ro" in mounts
    text = (ROOT / "docker-compose.yml").read_text()
    for var in OVERRIDABLE:
        assert "${" + var in text


@pytest.mark.parametrize("role", ["gateway", "prefill", "decode"])
def test_commands_parse_with_the_real_cli(role):
    cli = pytest.importorskip("scd_serve.cli")
    module = cli.COMMANDS[role][0]
    pytest.importorskip(module, reason=f"{module} has not landed yet")
    args = cli.build_parser(only=role).parse_args(worker_argv(role, {}))
    assert args.command == role


def _healthcheck_module():
    spec = importlib.util.spec_from_file_location("scd_healthcheck", ROOT / "deploy/docker/healthcheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_healthcheck_reads_role_and_port_from_the_command_line():
    hc = _healthcheck_module()
    for role in ("gateway", "prefill", "decode"):
        argv = ["/opt/venv/bin/python", "/opt/venv/bin/scd-serve"] + worker_argv(role, {})
        port = int(argv[argv.index("--port") + 1])
        assert hc.role_and_port(argv) == (role, port)
    assert hc.role_and_port(["scd-serve", "decode", "--port=9000"]) == ("decode", 9000)
    with pytest.raises(ValueError):
        hc.role_and_port(["scd-serve", "--help"])


def test_healthcheck_probe_fails_on_a_closed_port():
    hc = _healthcheck_module()
    assert hc.probe("gateway", 1) is False


# ---- secure by default: secrets made once, each role mounts only its own, mTLS on, locked down ----

SECRET_VARS = ("SCD_API_KEY", "SCD_WORKER_TOKEN", "SCD_CLUSTER_SECRET")
SECRETS_DIR = "/var/lib/scd-secrets"
# what each role needs: the control plane's secret everywhere, the API key where clients' keys are
# checked, the worker token on both ends of gRPC, and a worker's own certificate
NEEDS = {"gateway": {"scd-control:control", "scd-api-key:api"},
         "prefill": {"scd-control:control", "scd-worker-token:token", "scd-tls-prefill:tls"},
         "decode": {"scd-control:control", "scd-api-key:api", "scd-worker-token:token", "scd-tls-decode:tls"}}


def secret_mounts(svc: dict) -> set[str]:
    """'VOLUME:SUBDIR' of each secret volume a service mounts read-only; fails on a writable one."""
    out = set()
    for v in svc["volumes"]:
        source, target, *mode = interpolate(v, {}).split(":")
        if target.startswith(SECRETS_DIR + "/") or target.startswith("/run/scd-"):
            assert mode == ["ro"], f"{v} is writable"
            out.add(f"{source}:{target.rsplit('/', 1)[1]}")
    return out


def test_every_role_mounts_only_the_secrets_it_needs():
    for name, svc in SERVICES.items():
        assert svc["entrypoint"] == ["python", "/opt/scd/with_secrets.py", SECRETS_DIR, "--", "/bin/sh", "-c"], name
        assert secret_mounts(svc) == NEEDS[name], name
        for var in SECRET_VARS:  # your own value from .env wins; empty = the generated one
            assert svc["environment"][var] == "${" + var + ":-}", (name, var)
        assert svc["environment"]["SCD_MTLS"] == "${SCD_MTLS:-1}", name  # on unless SCD_MTLS=0
    for role in ("prefill", "decode"):
        gpu = COMPOSE["services"][f"{role}-gpu"]
        assert secret_mounts(gpu) == NEEDS[role]
    made = COMPOSE["services"]["secrets"]
    assert made["entrypoint"] == ["python", "/opt/scd/with_secrets.py", "--make", SECRETS_DIR]
    assert made["network_mode"] == "none" and made["restart"] == "no"
    written = {interpolate(v, {}) for v in made["volumes"]}
    volumes = {v.split(":")[0] for v in written}
    assert volumes == set(COMPOSE["volumes"]) and all(not v.endswith(":ro") for v in written)
    text = (ROOT / "docker-compose.yml").read_text()
    for var in SECRET_VARS:
        assert var + "=" not in text and var + ": \"" not in text, "no secret value in the compose file"
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    assert "for d in control api token tls tls-prefill tls-decode" in dockerfile  # each volume starts the user's
    assert "with_secrets.py" in dockerfile and "make-certs.sh" in dockerfile
    assert "!deploy/scripts/make-certs.sh" in (ROOT / ".dockerignore").read_text()


def test_every_container_is_locked_down():
    for name, svc in COMPOSE["services"].items():
        assert svc["cap_drop"] == ["ALL"], name
        assert svc["security_opt"] == ["no-new-privileges:true"], name
        assert svc["read_only"] is True, name
        assert re.fullmatch(r"\d+[mg]", interpolate(str(svc["mem_limit"]), {})), name
        if name != "secrets" and "prometheus" not in name and "grafana" not in name:
            assert "/tmp" in svc["tmpfs"] and svc["environment"]["SCD_CACHE_DIR"].startswith("/tmp/"), name
    grafana = COMPOSE["services"]["grafana"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana["environment"]  # no `admin` default any more
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/scd-grafana/admin-password"
    assert secret_mounts(grafana) == {"scd-grafana:scd-grafana"}
    assert COMPOSE["services"]["secrets"]["environment"]["SCD_GRAFANA_PASSWORD"] == "${SCD_GRAFANA_PASSWORD:-}"


def _check_role(role: str, argv: list[str], monkeypatch, env: dict[str, str]) -> None:
    import importlib

    cli = pytest.importorskip("scd_serve.cli")
    for var in SECRET_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    args = cli.build_parser(only=role).parse_args(argv)  # defaults read the environment
    module = importlib.import_module(cli.COMMANDS[role][0])
    from scd_serve.config.control import control_config_from_args

    config, control = module.config_from_args(args), control_config_from_args(args)
    module.check_exposure(config, control, args.insecure)


@pytest.mark.parametrize("role", ["gateway", "prefill", "decode"])
def test_compose_commands_pass_the_open_bind_check_only_with_the_secrets(role, monkeypatch):
    from scd_serve.errors import ConfigError

    argv = worker_argv(role, {})
    assert "--insecure" not in argv
    made = {var: f"generated-{var.lower()}-0123456789abcdef" for var in SECRET_VARS}
    _check_role(role, argv, monkeypatch, made)  # what with_secrets.py exports: accepted
    with pytest.raises(ConfigError, match="--insecure"):  # the same command without them: refused
        _check_role(role, argv, monkeypatch, {})


def test_mtls_is_on_by_default_and_adds_the_certificates():
    tls = {"SCD_TLS_DIR": f"{SECRETS_DIR}/tls"}  # what with_secrets.py exports when the certificates are there
    prefill, decode = worker_argv("prefill", {}, tls), worker_argv("decode", {}, tls)
    for argv, role in ((prefill, "prefill"), (decode, "decode")):
        assert argv[argv.index("--tls-cert") + 1] == f"{SECRETS_DIR}/tls/{role}.pem"
        assert argv[argv.index("--tls-key") + 1] == f"{SECRETS_DIR}/tls/{role}-key.pem"
        assert argv[argv.index("--tls-ca") + 1] == f"{SECRETS_DIR}/tls/ca.pem"
    assert decode[decode.index("--tls-server-name") + 1] == "prefill"  # the name in prefill.pem
    assert "--tls-cert" not in worker_argv("prefill", {}) and "--tls-cert" not in worker_argv("decode", {})
    cli = pytest.importorskip("scd_serve.cli")
    for role, argv in (("prefill", prefill), ("decode", decode)):
        args = cli.build_parser(only=role).parse_args(argv)
        assert args.tls_ca.endswith("/ca.pem")
    hc = _healthcheck_module()
    assert hc.flag_values(["scd-serve", *prefill]) == {"--tls-cert": f"{SECRETS_DIR}/tls/prefill.pem",
                                                       "--tls-key": f"{SECRETS_DIR}/tls/prefill-key.pem",
                                                       "--tls-ca": f"{SECRETS_DIR}/tls/ca.pem"}
    assert hc.flag_values(["scd-serve", "prefill", "--tls-ca=/x/ca.pem"]) == {"--tls-ca": "/x/ca.pem"}
    assert hc.flag_values(["scd-serve", "prefill", "--port", "1"]) == {}


def test_every_role_takes_its_options_from_dotenv_without_an_edit():
    """SCD_<OPTION> lines in .env (or $SCD_ENV_FILE) reach every role's container; a missing file is fine."""
    from scd_serve.cli import ENV_CONFIGURED

    for name, svc in SERVICES.items():
        (entry,) = svc["env_file"]
        assert entry["required"] is False, name
        assert interpolate(entry["path"], {}) == ".env"
        assert interpolate(entry["path"], {"SCD_ENV_FILE": "/etc/scd.env"}) == "/etc/scd.env"
        assert name in ENV_CONFIGURED  # the role reads SCD_* for its options


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_gpu_profile_runs_each_worker_on_a_gpu_in_bfloat16(role):
    """The `gpu` profile's workers: the CPU role's command with --device cuda --dtype bfloat16,
    the CUDA image built from TORCH_VARIANT, one GPU reserved; everything else the same."""
    from scd_serve.cli import build_parser

    services = COMPOSE["services"]
    gpu, cpu = services[f"{role}-gpu"], services[role]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["args"]["TORCH_VARIANT"] == "${SCD_TORCH_VARIANT:-cu128}"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert gpu["command"][0].replace("--device cuda --dtype bfloat16", "--device cpu") == cpu["command"][0]
    script = interpolate(gpu["command"][0], {})
    script = re.sub(r"\$\{\w+:\+[^}]*\}", "", script).replace("$(hostname -i | cut -d' ' -f1)", "172.18.0.5")
    argv = shlex.split(script)[1:]
    args = build_parser(role).parse_args(argv[1:])
    assert (args.device, args.dtype) == ("cuda", "bfloat16")
    same = ("entrypoint", "volumes", "healthcheck", "env_file", "expose")
    assert {k: gpu.get(k) for k in same} == {k: cpu.get(k) for k in same}
