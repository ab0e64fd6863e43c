"""A decode worker started with SCD_CPU_KERNELS=auto loads the machine's build of the CPU's C++
decode attention, says so, and serves the same tokens as a worker on the torch path (the real
command line, a real HTTP server, the openai client)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from polls import eventually_sync
from scd_serve.bench.procs import free_port
from scd_serve.model import cpu_kernel
from scd_serve.model.tiny import save_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_worker_serves_through_the_kernels_the_same_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV, "auto")
    if reason := cpu_kernel.unavailable_reason():
        pytest.skip(f"CPU kernels cannot be built here: {reason}")
    cpu_kernel.load()  # this machine's build, made now if there is none: the worker loads it at start
    model = str(save_tiny_model(tmp_path / "tiny", "llama", seed=0, num_hidden_layers=3))
    workers = {}
    try:
        for mode in ("off", "auto"):
            port, log = free_port(), tmp_path / f"{mode}.log"
            env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", cpu_kernel.ENV: mode}
            with open(log, "w") as out:
                proc = subprocess.Popen([sys.executable, "-m", "scd_serve.cli", "decode", "--model", model,
                                         "--codebook", "", "--method", "local", "--dtype", "float32", "--device", "cpu",
                                         "--host", "127.0.0.1", "--port", str(port)],
                                        env=env, stdout=out, stderr=subprocess.STDOUT)
            workers[mode] = (proc, log, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                                      timeout=60, max_retries=0))
        replies = {}
        for mode, (proc, log, client) in workers.items():
            assert eventually_sync(lambda: proc.poll() is not None or _ready(client), 300, 0.2), log.read_text()[-2000:]
            assert proc.poll() is None, log.read_text()[-2000:]
            # four prompts at once: their decode steps batch (one kernel call a layer for all four)
            with ThreadPoolExecutor(4) as pool:
                replies[mode] = list(pool.map(lambda i: client.completions.create(
                    model="tiny", prompt=f"abc {i} def " * (3 + 5 * i), max_tokens=12, temperature=0, logprobs=1),
                    range(4)))
        texts = {mode: [r.choices[0].text for r in rs] for mode, rs in replies.items()}
        assert texts["auto"] == texts["off"]
        for a, b in zip(replies["auto"], replies["off"]):
            assert a.choices[0].logprobs.token_logprobs == pytest.approx(b.choices[0].logprobs.token_logprobs, abs=1e-4)
        assert "CPU kernels loaded" in workers["auto"][1].read_text()
        assert "CPU kernels: not used (SCD_CPU_KERNELS=off)" in workers["off"][1].read_text()
    finally:
        for proc, _, _ in workers.values():
            proc.kill()
            proc.wait(30)


def _ready(client: openai.OpenAI) -> bool:
    try:
        return bool(client.models.list().data)
    except openai.OpenAIError:
        return False
