"""scd-serve installs like a library: declared dependencies, committed gRPC stubs, optional extras.

- the committed scd_serve/_proto equals a fresh generation from proto/ (`make proto`);
- constraints.txt pins every dependency pyproject.toml declares, inside its range;
- deptry: every third-party import of the package is declared, nothing declared is unused;
- the serving roles start without the optional extras, which name themselves when missing;
- (slow) a built wheel, installed into a fresh venv, serves a completion from a temp cwd.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import sysconfig
import threading
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from polls import eventually_sync

from scd_serve.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gen_proto  # noqa: E402  (scripts/gen_proto.py: the generator of the committed stubs)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OPTIONAL = ("psutil", "matplotlib", "asgi_lifespan", "grpc_tools")  # extras only (tqdm comes with transformers)


def test_committed_stubs_equal_a_fresh_generation():
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) generates the stubs")
    differ = [str(p.relative_to(ROOT)) for p in gen_proto.differences()]  # generates into a temp dir
    assert not differ, (f"{differ} differ from what proto/ generates with this grpcio-tools: run `make proto` "
                        f"(with the grpcio-tools of constraints.txt) and commit the result")


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_every_declared_dependency_inside_its_range():
    pins = _constraints()
    declared = list(PYPROJECT["build-system"]["requires"]) + list(PYPROJECT["project"]["dependencies"])
    for extra in PYPROJECT["project"]["optional-dependencies"].values():
        declared += extra
    for text in declared:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == "scd-serve":  # an extra naming the others
            continue
        assert name in pins, f"{req.name} is declared in pyproject.toml but not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {text!r}")
    assert pins["torch"] == "2.13.0"  # the CPU wheel on disk: any other version downloads CUDA
    assert "==" not in "".join(PYPROJECT["project"]["dependencies"]), "runtime dependencies are ranges"


def test_deptry_finds_every_import_declared():
    # configured in pyproject.toml [tool.deptry]; scans scd_serve/ and scripts/ (not tests/)
    out = subprocess.run([sys.executable, "-m", "deptry", ".", "--no-ansi"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"Scanning \d{2,} files", out.stdout + out.stderr), out.stdout + out.stderr


BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
sys.meta_path.insert(0, Block())
"""


def test_serving_roles_need_no_optional_extra():
    code = BLOCK.format(blocked=OPTIONAL) + """
from scd_serve import cli
import scd_serve.transport.proto
for role in ("prefill", "decode", "gateway", "up"):
    cli.build_parser(only=role)  # imports the role's module and its options
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def _tqdm_calibrate():
    from scd_serve.quality.calibrate import tqdm

    tqdm([], disable=True)


def _tqdm_eval():
    from scd_serve.quality.scorer import tqdm

    tqdm([], disable=True)


def _memory_check():
    from scd_serve.calibration.memory import available_bytes

    available_bytes("cpu")


def _tradeoff_figure(tmp_path):
    from scd_serve.calibration.curve import plot_tradeoff

    plot_tradeoff([], None, 1, 0.1, tmp_path / "x.png")


def _bench_figure(tmp_path):
    from scd_serve.bench import plot

    plot.ttft_vs_bandwidth({"sweep": []}, tmp_path / "x.png", 16)


def _soak_stack(tmp_path):
    import asyncio

    from scd_serve.testing.soak import LocalStack

    asyncio.run(LocalStack(None).start(prefill_addresses=("127.0.0.1:1",)))


def _soak(tmp_path):
    import asyncio

    from scd_serve.testing.soak import soak

    asyncio.run(soak(None, 0.0, 1, 0))


@pytest.mark.parametrize("call, module, extra", [
    (lambda tmp: _tqdm_calibrate(), "tqdm", "calibrate"),
    (lambda tmp: _tqdm_eval(), "tqdm", "calibrate"),
    (lambda tmp: _memory_check(), "psutil", "calibrate"),
    (_tradeoff_figure, "matplotlib", "calibrate"),
    (_bench_figure, "matplotlib", "bench"),
    (_soak_stack, "asgi_lifespan", "bench"),
    (_soak, "psutil", "bench"),
], ids=["calibrate-tqdm", "eval-tqdm", "memory-psutil", "curve-matplotlib", "bench-matplotlib",
        "soak-asgi_lifespan", "soak-psutil"])
def test_a_missing_optional_dependency_names_its_extra(call, module, extra, tmp_path, monkeypatch):
    for name in list(sys.modules):
        if name == module or name.startswith(module + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    with pytest.raises(ConfigError, match=re.escape(f"pip install 'scd-serve[{extra}]'")):
        call(tmp_path)


# ---- the built wheel, installed elsewhere ----------------------------------------------------

PAIR = ROOT / "models" / "demo-pair"
STAGED = ("pyproject.toml", "README.md", "scd_serve")  # what the wheel is built from


def _build_wheel(tmp: Path) -> Path:
    """`pip wheel` of a staged copy of the build inputs (an in-tree build would leave build/ in the
    checkout, and setuptools packs stale files from there); offline, with this venv's setuptools."""
    import shutil

    src = tmp / "src"
    src.mkdir()
    for name in STAGED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(src)], check=True, timeout=300, capture_output=True)
    (wheel,) = (tmp / "dist").glob("scd_serve-*.whl")
    return wheel


def _venv_with_our_dependencies(tmp: Path) -> Path:
    """A fresh venv that sees this venv's site-packages (torch & co., no download) through a .pth
    line, which adds the directory without running its .pth files (so not the editable install)."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    Path(purelib, "scd_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_wheel_installs_and_serves_from_anywhere(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "scd_serve/_proto/scd/v1/scd_pb2_grpc.py" in names and "scd_serve/cli.py" in names
    python = _venv_with_our_dependencies(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=300, capture_output=True)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    where = subprocess.run([str(python), "-c", "import scd_serve, scd_serve.transport.proto as p; "
                            "print(scd_serve.__file__, p.pb.__file__)"],
                           cwd=cwd, env=env, check=True, capture_output=True, text=True, timeout=120).stdout
    assert str(ROOT) not in where and where.startswith(str(tmp_path / "venv")), where  # the wheel, not the checkout
    exe = str(python.parent / "scd-serve")
    assert subprocess.run([exe, "--help"], cwd=cwd, env=env, capture_output=True, timeout=120).returncode == 0

    proc = subprocess.Popen([exe, "up", "--port", "0", "--producer", str(PAIR / "producer"),
                             "--consumer", str(PAIR / "consumer"), "--codebook", str(PAIR / "codebook"),
                             "--ready-timeout-s", "180"],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(ln) for ln in proc.stdout], daemon=True).start()

    def url():
        return next((m.group(1) for ln in lines if (m := re.search(r"is up: (http://\S+)/v1", ln))), None)

    try:
        assert eventually_sync(lambda: url() or proc.poll() is not None, 200, 0.2)
        assert url(), "".join(lines[-30:])
        base = url()
        assert base.startswith("http://127.0.0.1:"), base
        with httpx.Client(base_url=base, timeout=60, trust_env=False) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            r = http.post("/v1/completions", json={"model": model, "prompt": "records", "max_tokens": 4,
                                                   "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGINT)  # Ctrl-C: `up` stops its workers and exits
        assert proc.wait(60) == 0, "".join(lines[-30:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what this test started
            proc.wait(10)
