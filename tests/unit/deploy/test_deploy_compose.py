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
SERVICES = COMPOSE["services"]
OVERRIDABLE = ("SCD_PRODUCER", "SCD_CONSUMER", "SCD_CODEBOOK", "SCD_METHOD", "SCD_MODELS_DIR")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ${VAR:-default}, ${VAR}, and $$ for a literal $."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, default = m.group(1), m.group(3)
        return env.get(name) or (default if default is not None else "")
    return re.sub(r"\$\$|\$\{(\w+)(:-([^}]*))?\}", sub, text)


def worker_argv(service: str, env: dict[str, str]) -> list[str]:
    """The scd-serve argv a container runs: compose-interpolated, then split like sh would,
    with the container-address substitution replaced by an example IP."""
    (script,) = SERVICES[service]["command"]
    script = interpolate(script, env)
    inside = {k: interpolate(str(v), env) for k, v in SERVICES[service].get("environment", {}).items()}
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
    # no cycle: a topological order exists
    deps = {n: set(s.get("depends_on", {})) for n, s in SERVICES.items()}
    order: list[str] = []
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
