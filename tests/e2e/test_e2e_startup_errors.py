"""Errors a person can read at startup: a busy port, a missing model directory, a codebook of
another pair. Each role (`up`, `decode`, `prefill`, `gateway`, and `make run`) run as a real
process must exit 2 with one line on stderr that names the problem and what to do, and no
traceback."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
CONTEXT, DEMO = ROOT / "models" / "context-pair", ROOT / "models" / "demo-pair"
CLI = [sys.executable, "-m", "scd_serve.cli"]


@pytest.fixture
def busy_port():
    """A port something listens on (the test holds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def run(argv: list[str], env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=os.environ | {"OMP_NUM_THREADS": "1"} | (env or {}))


def one_error_line(res: subprocess.CompletedProcess, role: str, *words: str) -> str:
    """The process exited 2 with exactly one error line and no traceback; -> that line."""
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith(f"scd-serve {role}: error: ")]
    assert len(errors) == 1 and "Traceback" not in res.stderr + res.stdout, res.stderr[-2000:]
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


@pytest.mark.parametrize("role", ["gateway", "decode", "prefill", "up"])
def test_a_busy_port_is_one_line_and_exit_2(role, busy_port):
    extra = {"decode": ["--model", str(DEMO / "consumer")], "prefill": ["--model", str(DEMO / "producer")]}
    res = run([*CLI, role, "--port", str(busy_port), *extra.get(role, [])])
    one_error_line(res, role, f"port {busy_port}", "in use", "--port")


def test_a_busy_control_plane_port_of_the_gateway_is_one_line(busy_port):
    res = run([*CLI, "gateway", "--port", "0", "--control-bind", f"tcp://127.0.0.1:{busy_port}"])
    one_error_line(res, "gateway", f"port {busy_port}", "--control-bind")


@pytest.mark.parametrize("role,flag", [("decode", "--model"), ("prefill", "--model"), ("up", "--consumer")])
def test_a_missing_model_directory_is_one_line_and_exit_2(role, flag, tmp_path):
    res = run([*CLI, role, flag, str(tmp_path / "nowhere"), *(["--port", "0"] if role != "up" else [])])
    one_error_line(res, role, str(tmp_path / "nowhere"))


@pytest.mark.parametrize("role,model", [("decode", CONTEXT / "consumer"), ("prefill", CONTEXT / "producer")])
def test_a_codebook_of_another_pair_is_one_line_and_exit_2(role, model):
    res = run([*CLI, role, "--model", str(model), "--codebook", str(DEMO / "codebook"), "--port", "0"])
    one_error_line(res, role, "--codebook", "another pair", "--codebook ''")


def test_up_reports_its_workers_one_line_error_as_its_own():
    res = run([*CLI, "up", "--pair", "context", "--codebook", str(DEMO / "codebook"), "--port", "0"])
    line = one_error_line(res, "up", "another pair")
    assert line.startswith(("scd-serve up: error: prefill-0: ", "scd-serve up: error: decode-0: ")), line


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_run_on_a_busy_port_is_one_line(busy_port):
    # this interpreter's venv (BIN) and no reinstall (-o the stamp): only the recipe is under test
    res = run(["make", "-s", "-o", ".venv/.installed", "run", f"BIN={Path(sys.executable).parent}"],
              env={"SCD_PORT": str(busy_port)})
    assert res.returncode == 2, res.stderr[-2000:]
    ours = [ln for ln in res.stderr.splitlines() if ln.startswith("scd-serve up: error: ")]
    assert len(ours) == 1 and f"port {busy_port}" in ours[0] and "Traceback" not in res.stderr
