"""The compose cluster for real: up with secrets made on first start by the one-shot `secrets`
service (API key read from the gateway's volume; no key = 401), each role holding only its own
secrets, every container locked down (read-only root, no capabilities, no-new-privileges, a
memory limit), mTLS between the workers by default, completions through the published port
with the official openai client, each role scaled to 2 with every worker serving (gateway
/metrics), a prefill container killed under traffic, then `docker compose down` leaving
nothing. A second project checks the mTLS opt-out (SCD_MTLS=0).

Runs when `deploy/scripts/ci-docker.sh` has prepared the engine and built the image;
skips otherwise. Test traffic goes only to the gateway's port published on 127.0.0.1.
On failure every container's log is saved under artifacts/docker-e2e/<project>/.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from compose_cluster import LOG_ROOT, REQUEST_TIMEOUT_S, UP_TIMEOUT_S, Cluster, free_port, openai_client, require_engine, run

CLEAN_FAILURES = {429, 502, 503, 504}  # an error the API reports on purpose, with a JSON body
PROMPTS = ["The capital of France is", "Water boils at", "One plus one equals", "The sky is",
           "My favourite colour is", "Cats like to", "The train leaves at", "In the morning we"]

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(UP_TIMEOUT_S + 300)]


def served_by(samples) -> dict[str, float]:
    """Per worker address: 200s the gateway got from each decode worker, and the transfers
    each prefill worker reported as served in its heartbeats."""
    counts: dict[str, float] = {}
    for name, labels, value in samples:
        if name == "scd_gateway_requests_total" and labels.get("status") == "200":
            counts[labels["worker"]] = counts.get(labels["worker"], 0) + value
        elif name == "scd_worker_load" and labels.get("role") == "prefill" and labels.get("key") == "served":
            counts[labels["worker"]] = value
    return counts


@pytest.fixture(scope="module")
def cluster(request):
    require_engine()
    c = Cluster(project=f"scd-e2e-{uuid.uuid4().hex[:8]}", port=free_port())
    failed_before = request.session.testsfailed
    try:
        c.up()
        c.read_api_key()
    except BaseException:
        print(f"compose up failed; logs in {c.save_logs()}")
        c.down()
        raise
    yield c
    if request.session.testsfailed > failed_before:
        print(f"container logs saved in {c.save_logs()}")
    c.down()


# A transfer for sure: the workers' default `auto` may prefill locally instead (its choice
# follows measured speeds), and the tests that count what prefill workers served need transfers.
TRANSFER = {"scd_method": "scd"}


def complete(oc, model: str, prompt: str, max_tokens: int = 8, method: dict | None = None):
    return oc.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=method)


def test_secure_by_default(cluster):
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(f"{cluster.url}{path}", timeout=10).status_code == 401, path
        bad = {"authorization": "Bearer not-the-key"}
        assert httpx.get(f"{cluster.url}{path}", headers=bad, timeout=10).status_code == 401, path
    assert httpx.get(f"{cluster.url}/v1/models", headers=cluster.headers, timeout=10).status_code == 200
    # each role holds the generated secrets it needs and no other; nothing had to be configured
    files = ("control/cluster-secret", "api/api-key", "token/worker-token", "tls/ca.pem")
    held = {"gateway": [True, True, False, False], "prefill": [True, False, True, True],
            "decode": [True, True, True, True]}
    for service, want in held.items():
        out = cluster.compose("exec", "-T", service, "sh", "-c", "cd /var/lib/scd-secrets && for f in "
                              + " ".join(files) + "; do test -s $f && echo yes || echo no; done")
        assert out.stdout.split() == ["yes" if w else "no" for w in want], (service, out.stdout)
    tls = cluster.compose("exec", "-T", "prefill", "ls", "/var/lib/scd-secrets/tls").stdout.split()
    assert sorted(tls) == ["ca.pem", "prefill-key.pem", "prefill.pem"]  # mTLS on, its own certificate only
    for service in ("gateway", "prefill", "decode"):
        (cid,) = cluster.containers(service)
        host = json.loads(run("docker", "inspect", "-f", "{{json .HostConfig}}", cid).stdout)
        assert host["ReadonlyRootfs"] is True and host["CapDrop"] == ["ALL"], service
        assert "no-new-privileges:true" in host["SecurityOpt"] and host["Memory"] > 0, service
    # the control plane is CURVE: the gateway refused no worker and dropped nothing a worker sent
    dropped = [v for name, _, v in cluster.metrics() if name == "scd_control_dropped_messages_total"]
    assert sum(dropped) == 0, dropped


def test_completions_through_the_published_port(cluster):
    oc = openai_client(cluster)
    model = oc.models.list().data[0].id
    out = complete(oc, model, PROMPTS[0])
    assert out.choices[0].text and out.usage.completion_tokens > 0
    chat = oc.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi"}],
                                      max_tokens=8, temperature=0)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0
    chunks = list(oc.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)


def test_scaled_roles_all_serve(cluster):
    cluster.up("--scale", "prefill=2", "--scale", "decode=2")
    prefill = {cluster.address(cid, 50051) for cid in cluster.containers("prefill")}
    decode = {cluster.address(cid, 8001) for cid in cluster.containers("decode")}
    assert len(prefill) == 2 and len(decode) == 2
    oc = openai_client(cluster)
    model = oc.models.list().data[0].id
    # Workers join the gateway within a heartbeat; send rounds until every one has served.
    deadline = time.monotonic() + 120
    counts: dict[str, float] = {}
    while time.monotonic() < deadline:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: complete(oc, model, p, method=TRANSFER), PROMPTS))
        assert all(o.choices[0].text is not None for o in outs)
        counts = served_by(cluster.metrics())
        if all(counts.get(a, 0) > 0 for a in prefill | decode):
            break
    idle = sorted(a for a in prefill | decode if counts.get(a, 0) <= 0)
    assert not idle, f"workers that never served: {idle}; gateway counts {counts}"


def test_killed_prefill_under_traffic(cluster):
    oc = openai_client(cluster)
    model = oc.models.list().data[0].id
    victims = cluster.containers("prefill")
    assert len(victims) == 2, "runs after the scale-up"
    victim = victims[0]
    survivor = cluster.address(victims[1], 50051)
    results: list[tuple[float, float, str]] = []  # (start, end, outcome)
    lock = threading.Lock()
    stop = threading.Event()

    def traffic(worker: int) -> None:
        from openai import APIConnectionError, APIStatusError, APITimeoutError

        i = 0
        while not stop.is_set():
            start = time.monotonic()
            try:
                out = complete(oc, model, f"{PROMPTS[(worker + i) % len(PROMPTS)]} {i}", max_tokens=16,
                               method=TRANSFER)
                outcome = "ok" if out.choices[0].text is not None else "empty"
            except APITimeoutError:
                outcome = "hung"
            except APIStatusError as err:
                outcome = f"clean {err.status_code}" if err.status_code in CLEAN_FAILURES else f"bad {err.status_code}"
            except APIConnectionError as err:
                outcome = f"dropped {type(err).__name__}"
            with lock:
                results.append((start, time.monotonic(), outcome))
            i += 1

    threads = [threading.Thread(target=traffic, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    time.sleep(4)
    killed_at = time.monotonic()
    run("docker", "kill", victim)
    time.sleep(8)
    stop.set()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 10)
    assert not any(t.is_alive() for t in threads), "a client thread hung past its request timeout"
    spanning = [r for r in results if r[0] < killed_at < r[1]]
    assert spanning, "no request was in flight when the container was killed"
    bad = [r[2] for r in results if r[2] != "ok" and not r[2].startswith("clean")]
    assert not bad, f"requests neither completed nor failed cleanly: {bad}"
    # The cluster keeps serving, and the surviving prefill worker takes the transfers.
    before = served_by(cluster.metrics()).get(survivor, 0)
    outs = [complete(oc, model, f"{p} again", method=TRANSFER) for p in PROMPTS]
    assert all(o.choices[0].text is not None for o in outs)
    deadline = time.monotonic() + 10  # its next heartbeat carries the new count
    while served_by(cluster.metrics()).get(survivor, 0) <= before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert served_by(cluster.metrics()).get(survivor, 0) > before, "surviving prefill worker served nothing"
    assert httpx.get(f"{cluster.url}/ready", timeout=10).status_code == 200


def test_down_leaves_nothing(cluster):
    cluster.down()
    assert cluster.containers(running=False) == []
    label = f"label=com.docker.compose.project={cluster.project}"
    assert run("docker", "network", "ls", "-q", "--filter", label).stdout.split() == []
    assert run("docker", "volume", "ls", "-q", "--filter", label).stdout.split() == []


def test_mtls_opt_out():
    """SCD_MTLS=0, the one-line opt-out: no certificates, plaintext gRPC between the workers
    (the prefill health check follows the flags), transfers still flow. Runs after the first
    project is down: two clusters at once would not fit on two cores."""
    require_engine()
    # Settings from an env file, as users put them in .env: the opt-out, their own API key, and
    # one option of the roles by its SCD_<OPTION> name. No file of the project is edited.
    env_file = LOG_ROOT / f"plain-{uuid.uuid4().hex[:8]}.env"
    env_file.parent.mkdir(parents=True, exist_ok=True)
    key = uuid.uuid4().hex
    env_file.write_text(f"SCD_MTLS=0\nSCD_API_KEY={key}\nSCD_MAX_MODEL_LEN=64\n")
    c = Cluster(project=f"scd-e2e-plain-{uuid.uuid4().hex[:8]}", port=free_port(),
                extra_env={"SCD_ENV_FILE": str(env_file)}, env_file=str(env_file))
    try:
        c.up()
        assert httpx.get(f"{c.url}/v1/models", timeout=10).status_code == 401
        c.api_key = key
        assert httpx.get(f"{c.url}/v1/models", headers=c.headers, timeout=10).status_code == 200
        too_long = httpx.post(f"{c.url}/v1/completions", headers=c.headers, timeout=30,
                              json={"prompt": "hi", "max_tokens": 64})
        assert too_long.status_code == 400, too_long.text  # SCD_MAX_MODEL_LEN=64 reached the decode worker
        assert "maximum context length 64" in too_long.json()["error"]["message"], too_long.text
        listing = c.compose("exec", "-T", "prefill", "ls", "/var/lib/scd-secrets/tls").stdout.split()
        assert listing == [], listing
        cmdline = c.compose("exec", "-T", "prefill", "cat", "/proc/1/cmdline").stdout
        assert "--tls-cert" not in cmdline
        oc = openai_client(c)
        model = oc.models.list().data[0].id
        out = oc.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                    extra_body={"scd_method": "raw"})
        assert out.choices[0].text is not None
        served = [v for name, labels, v in c.metrics() if name == "scd_worker_load"
                  and labels.get("role") == "prefill" and labels.get("key") == "served"]
        deadline = time.monotonic() + 10  # the next heartbeat carries the count
        while sum(served) < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
            served = [v for name, labels, v in c.metrics() if name == "scd_worker_load"
                      and labels.get("role") == "prefill" and labels.get("key") == "served"]
        assert sum(served) >= 1, "no transfer went over plaintext gRPC"
    except BaseException:
        print(f"plaintext cluster logs in {c.save_logs()}")
        raise
    finally:
        c.down()
