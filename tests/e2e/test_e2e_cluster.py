"""`scd-serve up` as real processes: 2 prefill + 2 decode workers behind one gateway.

The official openai client gets completions and chat completions (streaming and not);
identity transfer gives the same greedy text as local prefill; both prefill and both
decode workers serve traffic (gateway /metrics); a SIGKILLed prefill worker is dropped,
requests keep succeeding and `up` restarts it; Ctrl-C stops every process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from scd_serve.model.tiny import save_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def metric_rows(base: str, name: str) -> list[tuple[dict, float]]:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    rows = []
    for m in re.finditer(rf"^{name}\{{(.*?)\}} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        rows.append((labels, float(m.group(2))))
    return rows


def wait_for(pred, timeout: float, step: float = 0.25):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(step)
    return pred()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("e2e") / "tiny", "llama", seed=0)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "scd_serve.cli", "up", "--port", "0", "--producer", str(model),
                             "--consumer", str(model), "--codebook", "", "--method", "identity",
                             "--prefill-workers", "2", "--decode-workers", "2", "--ready-timeout-s", "400"],
                            stdout=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(ln) for ln in proc.stdout], daemon=True).start()
    url = wait_for(lambda: next((m.group(1) for ln in lines if (m := re.search(r"is up: (http://\S+)/v1", ln))),
                                None) or (proc.poll() is not None and "exited"), 420, 0.5)
    if not url or url == "exited":
        proc.kill()
        pytest.fail(f"scd-serve up did not come up: {lines[-20:]}")
    yield proc, url
    if proc.poll() is None:  # the Ctrl-C test did not run (-k, -x): its workers go too, not only `up`
        workers = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        for w in workers:
            w.kill()
        psutil.wait_procs(workers, timeout=10)


def test_openai_client_and_lossless_transfer(cluster):
    _, base = cluster
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)
    assert client.models.list().data[0].id == "tiny"
    kw = dict(model="tiny", max_tokens=8, temperature=0)
    prompt = "The quick brown fox jumps"
    remote = client.completions.create(prompt=prompt, **kw)
    local = client.completions.create(prompt=prompt, extra_body={"scd_method": "local"}, **kw)
    assert remote.choices[0].text == local.choices[0].text and remote.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **kw)
                       if c.choices)
    assert streamed == local.choices[0].text
    msgs = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(messages=msgs, **kw)
    chat_stream = "".join(c.choices[0].delta.content or "" for c in
                          client.chat.completions.create(messages=msgs, stream=True, **kw) if c.choices)
    assert chat.choices[0].message.content == chat_stream and chat.usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=prompt, model="tiny", max_tokens=8, temperature=-1)
    assert "temperature" in str(e.value)


def test_all_four_workers_serve(cluster):
    _, base = cluster
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)
    prompts = [f"request number {i} says" for i in range(16)]

    def one(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as ex:
        together = list(ex.map(one, prompts))
    assert together == [one(p) for p in prompts]  # concurrent == one at a time, no cross-talk

    def served():
        decode = {lab["worker"] for lab, v in metric_rows(base, "scd_gateway_requests_total") if v > 0}
        prefill = {lab["worker"] for lab, v in metric_rows(base, "scd_worker_load")
                   if lab["role"] == "prefill" and lab["key"] == "served" and v > 0}
        return (decode, prefill) if len(decode) == 2 and len(prefill) == 2 else None
    assert wait_for(served, 15), metric_rows(base, "scd_worker_load")  # the next heartbeat carries the counts


@pytest.mark.xfail(strict=False, reason=(
    "known bug, open: a single-choice stream through the gateway whose whole output fits in the socket "
    "buffers (400 short events of the tiny model, ~0.4 s) is often generated to the end after the client "
    "left; with n=8 (8x the bytes) the abort reaches the worker within ~40 ms. Seen in about half the runs "
    "on 2026-12-04; the reliability suite's slower-step disconnect tests pass"))
def test_client_leaving_a_stream_stops_generation_behind_the_gateway(cluster):
    _, base = cluster

    def decode_load(key):
        return sum(v for lab, v in metric_rows(base, "scd_worker_load") if lab["role"] == "decode" and lab["key"] == key)

    def settled(key):
        """The count once earlier tests' work has reached the registry: idle, and unchanged across
        several heartbeats (a loaded machine delays them; a stale `before` counted their tokens here)."""
        first = decode_load(key)
        time.sleep(2.0)
        return decode_load("running") == 0 and decode_load(key) == first and [first]

    before = wait_for(lambda: settled("tokens"), 60)[0]
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events >= 3:
                break  # leave mid-stream: closing the connection must abort the request upstream
    assert wait_for(lambda: decode_load("running") == 0, 5), "generation kept running after the client left"
    time.sleep(1.0)  # a heartbeat later the token count has stopped growing well short of 400
    assert decode_load("tokens") - before < 400


def test_killed_prefill_worker_is_dropped_and_requests_still_succeed(cluster):
    proc, base = cluster
    rows = [lab["worker"] for lab, _ in metric_rows(base, "scd_worker_load")
            if lab["role"] == "prefill" and lab["key"] == "served"]
    assert len(set(rows)) == 2
    victim_addr = sorted(set(rows))[0]
    probe = [sys.executable, "-m", "scd_serve.transport.health_probe", victim_addr]
    assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
    port = int(victim_addr.rsplit(":", 1)[1])
    victim = next(c for c in psutil.Process(proc.pid).children() if "prefill" in c.cmdline() and
                  any(cn.laddr.port == port for cn in c.net_connections("tcp") if cn.status == psutil.CONN_LISTEN))
    victim.send_signal(signal.SIGKILL)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)
    t0 = time.monotonic()
    texts = [client.completions.create(model="tiny", prompt=f"after the crash {i}", max_tokens=4,
                                       temperature=0).choices[0].text for i in range(6)]
    assert len(texts) == 6 and time.monotonic() - t0 < 60
    gone = wait_for(lambda: victim_addr not in {lab["worker"] for lab, _ in metric_rows(base, "scd_worker_load")}, 10)
    assert gone, "the registry still lists the killed prefill worker"
    assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 1
    # `up` restarts it; it rejoins under a new port
    back = wait_for(lambda: len({lab["worker"] for lab, _ in metric_rows(base, "scd_worker_load")
                                 if lab["role"] == "prefill"}) == 2, 180, 1.0)
    assert back, "the crashed prefill worker was not restarted"


def test_ctrl_c_stops_every_process(cluster):
    proc, _ = cluster
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 5  # gateway, 2 decode, 2 prefill
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []
