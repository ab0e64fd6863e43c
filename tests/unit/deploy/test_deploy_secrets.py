"""The compose secrets (deploy/docker/with_secrets.py) and the certificate script
(deploy/scripts/make-certs.sh), run for real on this machine: the one-shot `--make` makes each
secret once (concurrent runs agree), each role gets exactly what it mounts, a value from .env
wins, mTLS is on unless SCD_MTLS=0, and the certificates carry mTLS between a gRPC server and
client."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
WRAPPER = ROOT / "deploy" / "docker" / "with_secrets.py"
MAKE_CERTS = ROOT / "deploy" / "scripts" / "make-certs.sh"
VARS = ("SCD_CLUSTER_SECRET", "SCD_API_KEY", "SCD_WORKER_TOKEN")
PRINT_ENV = "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('SCD_')}))"
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")
# a role's view of the volumes (docker-compose.yml): sub-directory there <- the volume's own
MOUNTS = {"gateway": {"control": "control", "api": "api"},
          "prefill": {"control": "control", "token": "token", "tls": "tls-prefill"},
          "decode": {"control": "control", "api": "api", "token": "token", "tls": "tls-decode"}}


def make(directory: Path, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, str(WRAPPER), "--make", str(directory)],
                   env={"PATH": "/usr/bin:/bin", **(env or {})}, capture_output=True, text=True, timeout=120, check=True)


def role(made: Path, name: str, tmp: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the role `name`'s command gets, with only its volumes mounted."""
    view = tmp / f"view-{name}"
    view.mkdir(exist_ok=True)
    for sub, volume in MOUNTS[name].items():
        if not (view / sub).exists():
            (view / sub).symlink_to(made / volume)
    out = subprocess.run([sys.executable, str(WRAPPER), str(view), "--", sys.executable, "-c", PRINT_ENV],
                         env={"PATH": "/usr/bin:/bin", **(env or {})}, capture_output=True, text=True, timeout=60,
                         check=True)
    return json.loads(out.stdout)


@needs_openssl
def test_make_once_then_each_role_gets_only_what_it_mounts(tmp_path):
    made = tmp_path / "volumes"
    make(made)
    first = {p.relative_to(made).as_posix(): p.read_text() for p in made.rglob("*") if p.is_file()}
    assert set(first) == {"control/cluster-secret", "api/api-key", "token/worker-token", "grafana/admin-password",
                          "tls-prefill/ca.pem", "tls-prefill/prefill.pem", "tls-prefill/prefill-key.pem",
                          "tls-decode/ca.pem", "tls-decode/decode.pem", "tls-decode/decode-key.pem"}
    assert first["tls-prefill/ca.pem"] == first["tls-decode/ca.pem"]  # one CA signed both
    assert (made / "tls-prefill" / "prefill-key.pem").stat().st_mode & 0o077 == 0
    assert (made / "grafana" / "admin-password").stat().st_mode & 0o777 == 0o444  # Grafana's own user reads it
    make(made)  # a second `up`: nothing is made again
    assert {p.relative_to(made).as_posix(): p.read_text() for p in made.rglob("*") if p.is_file()} == first
    envs = {name: role(made, name, tmp_path) for name in MOUNTS}
    for name, env in envs.items():
        assert {v for v in VARS if v in env} == {"SCD_CLUSTER_SECRET", "SCD_API_KEY", "SCD_WORKER_TOKEN"} & {
            {"control": "SCD_CLUSTER_SECRET", "api": "SCD_API_KEY", "token": "SCD_WORKER_TOKEN"}[m]
            for m in MOUNTS[name] if m != "tls"}, name
        assert all(len(env[v]) == 64 for v in VARS if v in env)
    assert "SCD_API_KEY" not in envs["prefill"] and "SCD_TLS_DIR" not in envs["gateway"]
    for name in ("prefill", "decode"):  # mTLS is on by default
        tls = Path(envs[name]["SCD_TLS_DIR"])
        assert sorted(p.name for p in tls.iterdir()) == sorted(["ca.pem", f"{name}.pem", f"{name}-key.pem"])


def test_concurrent_makes_agree_and_mtls_opts_out(tmp_path):
    made = tmp_path / "volumes"
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda _: make(made, {"SCD_MTLS": "0"}), range(6)))
    values = {p.relative_to(made).as_posix(): p.read_text() for p in made.rglob("*") if p.is_file()}
    assert set(values) == {"control/cluster-secret", "api/api-key", "token/worker-token", "grafana/admin-password"}
    assert not [p for p in made.rglob(".*")]  # no temp file left
    assert "SCD_TLS_DIR" not in role(made, "decode", tmp_path, {"SCD_MTLS": "0"})


def test_a_value_from_the_environment_wins(tmp_path):
    made = tmp_path / "volumes"
    make(made, {"SCD_MTLS": "0", "SCD_GRAFANA_PASSWORD": "my-grafana-password"})
    assert (made / "grafana" / "admin-password").read_text().strip() == "my-grafana-password"
    got = role(made, "decode", tmp_path, {"SCD_API_KEY": "my-own-key-0123456789", "SCD_WORKER_TOKEN": ""})
    assert got["SCD_API_KEY"] == "my-own-key-0123456789"
    assert got["SCD_WORKER_TOKEN"] == (made / "token" / "worker-token").read_text().strip()  # empty: generated


def test_usage_error_without_a_command(tmp_path):
    r = subprocess.run([sys.executable, str(WRAPPER), str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "with_secrets.py DIR -- COMMAND" in r.stderr
    assert os.listdir(tmp_path) == []


@needs_openssl
async def test_certificates_carry_mtls_between_prefill_and_decode(tmp_path):
    from scd_serve.config.transport import TransportConfig
    from scd_serve.transport.health_probe import probe
    from scd_serve.transport.server import bind, make_server, set_serving

    subprocess.run(["sh", str(MAKE_CERTS), str(tmp_path)], check=True, capture_output=True, timeout=60)
    c = {p.stem: str(p) for p in tmp_path.glob("*.pem")}
    server_cfg = TransportConfig(tls_cert=c["prefill"], tls_key=c["prefill-key"], tls_ca=c["ca"])
    server, health = make_server(server_cfg)
    port = bind(server, "127.0.0.1", 0, server_cfg)
    await server.start()
    await set_serving(health, "scd.v1.PrefillService", True)
    try:
        decode = TransportConfig(rpc_timeout_s=3, tls_cert=c["decode"], tls_key=c["decode-key"], tls_ca=c["ca"],
                                 tls_server_name="prefill")
        assert await probe(f"127.0.0.1:{port}", decode, 3)
        # the prefill container's own health check: its own certificate, 127.0.0.1 in the SAN
        own = TransportConfig(rpc_timeout_s=3, tls_cert=c["prefill"], tls_key=c["prefill-key"], tls_ca=c["ca"])
        assert await probe(f"127.0.0.1:{port}", own, 3)
        no_client_cert = TransportConfig(rpc_timeout_s=2, tls_ca=c["ca"], tls_server_name="prefill")
        assert not await probe(f"127.0.0.1:{port}", no_client_cert, 2)
        assert not await probe(f"127.0.0.1:{port}", TransportConfig(rpc_timeout_s=2), 2)  # plaintext
        wrong_name = TransportConfig(rpc_timeout_s=2, tls_cert=c["decode"], tls_key=c["decode-key"],
                                     tls_ca=c["ca"], tls_server_name="decode")
        assert not await probe(f"127.0.0.1:{port}", wrong_name, 2)
    finally:
        await server.stop(None)
