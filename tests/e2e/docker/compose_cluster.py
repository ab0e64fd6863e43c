"""A compose project driven from tests: up, down, logs, the generated API key, /metrics.

Shared by the Docker e2e tests (test_compose.py, test_monitoring.py). Test traffic goes only
to ports published on 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[3]
IMAGE = os.environ.get("SCD_IMAGE", "scd-serve:local")
LOG_ROOT = Path(os.environ.get("SCD_E2E_LOG_DIR", ROOT / "artifacts" / "docker-e2e"))
UP_TIMEOUT_S = 300  # model loading on 2 shared cores, several containers at once
REQUEST_TIMEOUT_S = 60  # a request that takes longer counts as hung


def run(*args: str, timeout: float = 60, check: bool = True, env=None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{' '.join(args)} did not finish within {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def engine_missing(*images: str) -> str | None:
    """Why this machine cannot run the test (the project image and `images` needed), or None."""
    if shutil.which("docker") is None:
        return "no docker CLI: run deploy/scripts/ci-docker.sh"
    checks = [(("docker", "info"), "engine"), (("docker", "compose", "version"), "compose v2")]
    checks += [(("docker", "image", "inspect", image), f"image {image}") for image in (IMAGE, *images)]
    for args, what in checks:
        if subprocess.run(args, capture_output=True, timeout=30).returncode != 0:
            return f"no Docker {what}: run deploy/scripts/ci-docker.sh first"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SECRET_VARS = ("SCD_API_KEY", "SCD_WORKER_TOKEN", "SCD_CLUSTER_SECRET", "SCD_MTLS")


@dataclass
class Cluster:
    project: str
    port: int
    extra_env: dict | None = None
    api_key: str = ""
    env_file: str = ""  # compose --env-file (variables for the compose file itself)
    overrides: tuple[str, ...] = ()  # more compose files, after docker-compose.yml (-f each)

    @property
    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if k not in SECRET_VARS}  # the generated ones are tested
        return {**base, "SCD_HTTP_PORT": str(self.port), "SCD_IMAGE": IMAGE, **(self.extra_env or {})}

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"}

    def read_api_key(self) -> str:
        """The key the containers made on first start, as the docs tell users to read it."""
        out = self.compose("exec", "-T", "gateway", "cat", "/var/lib/scd-secrets/api/api-key").stdout.strip()
        assert len(out) == 64, "expected 32 random bytes in hex"
        self.api_key = out
        return out

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        env_file = ["--env-file", self.env_file] if self.env_file else []
        files = [arg for f in ("docker-compose.yml", *self.overrides) for arg in ("-f", str(ROOT / f))]
        return run("docker", "compose", "-p", self.project, *files, *env_file, *args,
                   timeout=timeout, check=check, env=self.env)

    def up(self, *args: str) -> None:
        self.compose("up", "-d", "--no-build", "--wait", "--wait-timeout", str(UP_TIMEOUT_S), *args,
                     timeout=UP_TIMEOUT_S + 60)

    def containers(self, service: str | None = None, running: bool = True) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        out = run("docker", "ps", *([] if running else ["-a"]), "-q", *filters).stdout
        return out.split()

    def address(self, container: str, port: int) -> str:
        ip = run("docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
                 container).stdout.split()[0]
        return f"{ip}:{port}"

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        return parse_prometheus(text)

    def save_logs(self) -> Path:
        out = LOG_ROOT / self.project
        out.mkdir(parents=True, exist_ok=True)
        (out / "compose-ps.txt").write_text(self.compose("ps", "-a", check=False).stdout)
        for cid in self.containers(running=False):
            name = run("docker", "inspect", "-f", "{{.Name}}", cid, check=False).stdout.strip().lstrip("/") or cid
            logs = run("docker", "logs", "--timestamps", cid, check=False, timeout=60)
            (out / f"{name}.log").write_text(logs.stdout + logs.stderr)
            state = run("docker", "inspect", "-f", "{{json .State}}", cid, check=False)
            (out / f"{name}.state.json").write_text(state.stdout)
        return out

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "15", timeout=180)


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for each sample line of the text exposition format."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, labels = head, {}
        if "{" in head:
            name, rest = head.split("{", 1)
            for part in rest.rstrip("}").split('",'):
                if part:
                    key, val = part.split("=", 1)
                    labels[key.strip(",")] = val.strip('"')
        samples.append((name, labels, float(value)))
    return samples


def openai_client(c: Cluster):
    from openai import OpenAI

    return OpenAI(base_url=f"{c.url}/v1", api_key=c.api_key, timeout=REQUEST_TIMEOUT_S, max_retries=0)


def require_engine(*images: str) -> None:
    """Skip without a Docker engine, compose v2 and the images; fail instead in CI's Docker
    stage (SCD_REQUIRE_DOCKER=1), where a skip would hide a broken setup."""
    why = engine_missing(*images)
    if why and os.environ.get("SCD_REQUIRE_DOCKER") == "1":
        pytest.fail(f"SCD_REQUIRE_DOCKER=1 but {why}")
    if why:
        pytest.skip(why)
