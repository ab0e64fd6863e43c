"""The compose entrypoint that makes the cluster's secrets (deploy/docker/with_secrets.py) and the
certificate script (deploy/scripts/make-certs.sh), run for real on this machine: containers
starting together agree on one value, a value from .env wins, and the certificates carry
mTLS between a gRPC server and client."""

from __future__ import annotations

import json
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


def run_wrapper(directory: Path, env: dict[str, str] | None = None, timeout: float = 60) -> dict[str, str]:
    base = {"PATH": "/usr/bin:/bin", **(env or {})}
    out = subprocess.run([sys.executable, str(WRAPPER), str(directory), "--", sys.executable, "-c", PRINT_ENV],
                         env=base, capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(out.stdout)


def test_first_start_makes_secrets_and_later_starts_reuse_them(tmp_path):
    first = run_wrapper(tmp_path)
    for var in VARS:
        assert len(first[var]) == 64 and int(first[var], 16) >= 0
    assert len({first[v] for v in VARS}) == 3
    assert run_wrapper(tmp_path) == first  # a restarted container gets the same values
    assert {p.name for p in tmp_path.iterdir()} == {"cluster-secret", "api-key", "worker-token"}  # no temp left
    assert "SCD_TLS_DIR" not in first


def test_containers_starting_together_agree(tmp_path):
    with ThreadPoolExecutor(8) as pool:
        seen = list(pool.map(lambda _: run_wrapper(tmp_path), range(8)))
    assert all(s == seen[0] for s in seen)


def test_a_value_from_the_environment_wins_and_empty_means_generate(tmp_path):
    got = run_wrapper(tmp_path, {"SCD_API_KEY": "my-own-key-0123456789", "SCD_WORKER_TOKEN": ""})
    assert got["SCD_API_KEY"] == "my-own-key-0123456789"
    assert len(got["SCD_WORKER_TOKEN"]) == 64
    assert not (tmp_path / "api-key").exists()


def test_usage_error_without_a_command(tmp_path):
    r = subprocess.run([sys.executable, str(WRAPPER), str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "with_secrets.py DIR -- COMMAND" in r.stderr


@needs_openssl
def test_mtls_switch_makes_certificates_once(tmp_path):
    with ThreadPoolExecutor(3) as pool:
        seen = list(pool.map(lambda _: run_wrapper(tmp_path, {"SCD_MTLS": "1"}), range(3)))
    tls = Path(seen[0]["SCD_TLS_DIR"])
    assert all(s["SCD_TLS_DIR"] == str(tls) for s in seen) and tls == tmp_path / "tls"
    assert {p.name for p in tls.iterdir()} == {"ca.pem", "prefill.pem", "prefill-key.pem", "decode.pem",
                                               "decode-key.pem"}  # the CA key is not left on the workers
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tls.")]
    assert (tls / "prefill-key.pem").stat().st_mode & 0o077 == 0


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
