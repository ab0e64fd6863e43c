"""K. Security: API key on every route, worker token, mTLS, no unsafe deserialization, loopback
defaults, log and error-body hygiene, CORS off."""

import ast
import logging
import pathlib

import grpc
import pytest
import yaml

from rel_checks import assert_clean
from scd_serve.api import auth
from scd_serve.config.api import ApiConfig
from scd_serve.config.decode import DecodeConfig
from scd_serve.config.gateway import GatewayConfig
from scd_serve.config.prefill import PrefillConfig
from scd_serve.config.transport import TransportConfig
from scd_serve.testing.faults import FaultyServicer
from scd_serve.testing.soak import completion
from scd_serve.transport.client import PrefillClient
from scd_serve.transport.proto import pb

pytestmark = pytest.mark.timeout(60)
KEY = "k3y-for-tests-0123456789"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def all_routes(routes):
    """Every route with a path, descending into included routers (FastAPI wraps them)."""
    for r in routes:
        if getattr(r, "path", None) is not None:
            yield r
        inner = getattr(r, "original_router", None) or getattr(r, "app", None)
        if getattr(inner, "routes", None) and inner is not r:
            yield from all_routes(inner.routes)


@pytest.fixture
async def keyed(make_stack):
    stack, base = await make_stack(warm=False, api={"api_key": KEY})
    stack.client.headers["authorization"] = f"Bearer {KEY}"
    await stack.client.post("/v1/completions", json=completion("warm", 2))
    del stack.client.headers["authorization"]
    stack.base = base
    return stack


PROBES = {"/live", "/ready", "/health"}  # the only open routes: probes carry no secret


async def test_k1_every_route_but_live_ready_needs_the_key(keyed):
    assert auth.OPEN_PATHS == PROBES  # a new open route is a decision this test has to be told about
    routes = [(r.path, m) for r in all_routes(keyed.app.routes) for m in sorted(r.methods or {"GET"})]
    assert {p for p, _ in routes} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics",
                                      "/openapi.json", "/docs", *PROBES}
    for path, method in routes:
        r = await keyed.client.request(method, path, json={} if method == "POST" else None)
        if path in PROBES:
            assert r.status_code == 200, (path, r.status_code)
        else:
            assert r.status_code == 401, (method, path, r.status_code)
            if method != "HEAD":
                assert r.json()["error"]["type"] == "authentication_error"
    # prefix and normalisation tricks (vLLM #58144): never open
    for path in ["/live/../v1/models", "/ready/../metrics", "/health/../v1/models", "//v1/models", "/v1/models/", "/live/x",
                 "/LIVE", "/v1/completions?x=/live", "/%2e%2e/v1/models", "/nonexistent"]:
        r = await keyed.client.get(path)
        assert r.status_code == 401, (path, r.status_code)
    r = await keyed.client.post("/v1/completions", json=completion("ok", 2), headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200


async def test_k2_wrong_key_query_key_trailing_space_constant_time_never_logged(keyed, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    seen = []
    real = auth.secrets.compare_digest
    monkeypatch.setattr(auth.secrets, "compare_digest", lambda a, b: seen.append(1) or real(a, b))
    body = completion("hello", 2)
    bad = [({"authorization": "Bearer wrong-key-0000000000"}, ""), ({}, f"?api_key={KEY}"),
           ({}, f"?key={KEY}"), ({"authorization": f"Bearer {KEY} "}, ""), ({"authorization": f"Bearer  {KEY}"}, ""),
           ({"authorization": KEY}, ""), ({"authorization": f"Basic {KEY}"}, ""), ({"x-api-key": KEY}, ""),
           ({"authorization": f"Bearer {KEY[:-1]}"}, ""), ({"authorization": b"Bearer \xe9\xff"}, "")]
    for headers, query in bad:
        r = await keyed.client.post("/v1/completions" + query, json=body, headers=headers)
        assert r.status_code == 401, (headers, query)
        assert KEY not in r.text
    assert len(seen) >= len(bad) - 2  # every header present went through compare_digest
    r = await keyed.client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    server_logs = "\n".join(r.getMessage() + str(r.args) for r in caplog.records if not r.name.startswith("httpx"))
    assert KEY not in server_logs
    assert KEY not in repr(keyed.app.state.config)


async def test_k3_worker_token_required_before_any_work(make_stack):
    transport = TransportConfig(rpc_timeout_s=2, prefill_timeout_s=10, worker_token="worker-secret-123")
    stack, base = await make_stack(warm=False, transport=transport, servicer_wrap=lambda sv: FaultyServicer(sv))
    addr = f"127.0.0.1:{stack.prefill_port}"
    for token in ["", "wrong-token", "worker-secret-123 "]:
        client = PrefillClient(addr, TransportConfig(rpc_timeout_s=2, worker_token=token) if token.strip()
                               else TransportConfig(rpc_timeout_s=2))
        if token.endswith(" "):  # a raw trailing space in metadata
            client.deadlines.metadata = (("authorization", f"Bearer {token}"),)
        try:
            for call in (lambda: client.info(), lambda: client.abort("x", "y")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # explicit metadata on the stream: the channel's own token is replaced by the bad one
            md = (("authorization", f"Bearer {token}"),) if token else ()
            stream = client._stub.Prefill(pb.PrefillRequest(request_id="k3", token_ids=[1, 2], method="identity"),
                                          timeout=2, metadata=md)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stream:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert await client.serving()  # health stays open for probes
        finally:
            await client.close()
    assert stack.served.calls == []  # no handler ran
    assert stack.servicer.num_prefills == 0
    await assert_clean(stack, base, fresh=False)


RAW = dict(request_serializer=None, response_deserializer=None)  # bytes in and out: the attacker's own encoding


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_k3_unauthenticated_63_mb_messages_are_refused_unread(model_dir, tmp_path, monkeypatch):
    """The issue's reproducer: the denial handler took the method's message type, so grpc received
    and parsed up to 64 MiB before the token check (8 x 63 MB: RSS 975 -> 1,915 MB), and garbage
    got parser details back and an ERROR traceback per call. A real `scd-serve prefill` process."""
    import threading

    import psutil

    from rel_procs import Proc

    monkeypatch.setenv("SCD_WORKER_TOKEN", "worker-secret-123")
    worker = Proc(tmp_path, ["prefill", "--model", str(model_dir), "--codebook", "", "--port", "0"])
    try:
        port = await worker.started()
        proc = psutil.Process(worker.p.pid)
        rss0, peak, done = proc.memory_info().rss, [0], threading.Event()

        def sample():  # the peak, not the end: a parsed message is freed after its call
            while not done.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                done.wait(0.01)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        big = pb.PrefillRequest(request_id="x" * (63 * 2**20), token_ids=[1, 2], method="identity").SerializeToString()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
                ("grpc.max_send_message_length", 1 << 27), ("grpc.max_receive_message_length", 1 << 27)]) as ch:
            prefill = ch.unary_stream("/scd.v1.PrefillService/Prefill", **RAW)
            info = ch.unary_unary("/scd.v1.PrefillService/Info", **RAW)
            codes = []
            for payload in [big] * 8 + [b"\xff\xfe garbage \x00" * 64]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in prefill(payload, timeout=60):
                        pass
                codes.append((e.value.code(), e.value.details()))
            done.set()
            sampler.join(5)
            growth = (peak[0] - rss0) / 2**20
            print(f"\nprefill worker RSS {rss0 / 2**20:.0f} MiB, peak {peak[0] / 2**20:.0f} MiB during 8 unauthenticated "
                  f"63 MB messages")
            assert growth < 50, f"RSS grew {growth:.0f} MiB: the messages were read"
            assert set(codes) == {(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token")}, codes[-1]
            # with the token: garbage gets INVALID_ARGUMENT and no parser details, valid bytes are served
            md = (("authorization", "Bearer worker-secret-123"),)
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await info(b"\x0a\xff\xff\xff\xff\xff garbage", timeout=10, metadata=md)
                assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                               "malformed request message")
            reply = pb.InfoReply.FromString(await info(pb.InfoRequest().SerializeToString(), timeout=10, metadata=md))
            assert reply.num_layers == 2
    finally:
        worker.stop()
    log = worker.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    assert log.count("not a valid message") == 1, log[-3000:]  # one counted warning for the three


async def test_k3_decode_with_the_right_token_transfers(make_stack):
    transport = TransportConfig(rpc_timeout_s=2, prefill_timeout_s=10, worker_token="worker-secret-123")
    stack, base = await make_stack(warm=False, transport=transport, health_loop=False)
    r = await stack.client.post("/v1/completions", json=completion("authorized", 3, scd_method="identity"))
    assert r.status_code == 200
    assert stack.fill.stats.num_transfers == 1 and stack.engine.num_fallbacks == 0


def _tls_files(tmp_path, ca, name, *identities):
    cert = ca.issue_cert(*identities)
    paths = {}
    for kind, blob in [("cert", cert.cert_chain_pems[0].bytes()), ("key", cert.private_key_pem.bytes())]:
        p = tmp_path / f"{name}-{kind}.pem"
        p.write_bytes(blob)
        paths[kind] = str(p)
    return paths


async def test_k4_mtls_with_trustme(make_stack, tmp_path):
    import trustme
    from cryptography import x509

    ca, other_ca = trustme.CA(), trustme.CA()
    ca_path, other_path = tmp_path / "ca.pem", tmp_path / "other-ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    other_ca.cert_pem.write_to_path(str(other_path))
    server = _tls_files(tmp_path, ca, "server", "localhost", "127.0.0.1")
    client_ok = _tls_files(tmp_path, ca, "client", "decode-worker")
    client_bad = _tls_files(tmp_path, other_ca, "intruder", "decode-worker")
    transport = TransportConfig(rpc_timeout_s=2, prefill_timeout_s=10, tls_cert=server["cert"], tls_key=server["key"],
                                tls_ca=str(ca_path), tls_server_name="localhost")
    # the decode side of the stack uses the same config: it presents a server-CA-signed cert too
    stack, base = await make_stack(transport=transport)
    addr = f"127.0.0.1:{stack.prefill_port}"
    san = x509.load_pem_x509_certificate(pathlib.Path(server["cert"]).read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert "127.0.0.1" in [str(i) for i in san.get_values_for_type(x509.IPAddress)]
    attempts = {
        "plaintext": TransportConfig(rpc_timeout_s=1.5),
        "other CA client cert": TransportConfig(rpc_timeout_s=1.5, tls_cert=client_bad["cert"], tls_key=client_bad["key"],
                                                tls_ca=str(ca_path), tls_server_name="localhost"),
        "no client cert": TransportConfig(rpc_timeout_s=1.5, tls_ca=str(ca_path), tls_server_name="localhost"),
        "server from other CA": TransportConfig(rpc_timeout_s=1.5, tls_cert=client_ok["cert"], tls_key=client_ok["key"],
                                                tls_ca=str(other_path), tls_server_name="localhost"),
    }
    for name, cfg in attempts.items():
        client = PrefillClient(addr, cfg)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.info(timeout=1.5)
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), name
        finally:
            await client.close()
    good = PrefillClient(addr, TransportConfig(rpc_timeout_s=2, tls_cert=client_ok["cert"], tls_key=client_ok["key"],
                                               tls_ca=str(ca_path), tls_server_name="localhost"))
    try:
        assert (await good.info()).num_layers == 2
    finally:
        await good.close()
    r = await stack.client.post("/v1/completions", json=completion("over mtls", 3, scd_method="identity"))
    assert r.status_code == 200 and stack.fill.stats.num_transfers >= 2
    await assert_clean(stack, base)


UNSAFE_CALLS = {("pickle", "load"), ("pickle", "loads"), ("marshal", "loads"), ("marshal", "load"),
                ("dill", "loads"), ("shelve", "open"), ("jsonpickle", "decode")}


def unsafe_sites(root: pathlib.Path) -> list[str]:
    hits = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        for needle in ("recv_pyobj", "send_pyobj", "__reduce__"):
            if needle in text:
                hits.append(f"{path}: {needle}")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            f, where = node.func, f"{path}:{node.lineno}"
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(f, ast.Name) and f.id in ("eval", "exec", "__import__"):
                hits.append(f"{where}: {f.id}(")
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                pair = (f.value.id, f.attr)
                if pair in UNSAFE_CALLS:
                    hits.append(f"{where}: {'.'.join(pair)}(")
                if pair == ("torch", "load"):
                    ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                    if not ok:
                        hits.append(f"{where}: torch.load( without weights_only=True")
                if pair == ("yaml", "load") and not (isinstance(kw.get("Loader"), ast.Attribute)
                                                     and "Safe" in kw["Loader"].attr):
                    hits.append(f"{where}: yaml.load( without a safe loader")
                if pair in (("yaml", "unsafe_load"), ("yaml", "full_load")):
                    hits.append(f"{where}: {'.'.join(pair)}(")
    return hits


def test_k5_static_check_no_unsafe_deserialization_or_eval(tmp_path):
    # the checker itself finds each pattern
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle, torch, yaml\npickle.loads(b'')\neval('1')\ntorch.load('x')\n"
                   "torch.load('y', weights_only=False)\nyaml.load('a')\nsock.recv_pyobj()\nexec('2')\n")
    assert len(unsafe_sites(tmp_path)) == 7
    (tmp_path / "bad.py").write_text("import torch, yaml\ntorch.load('x', weights_only=True)\n"
                                     "yaml.load('a', Loader=yaml.SafeLoader)\nmodel.eval()\n")
    assert unsafe_sites(tmp_path) == []
    assert unsafe_sites(ROOT / "scd_serve") == []


def test_k6_listeners_default_to_loopback_and_compose_publishes_only_api():
    assert ApiConfig().host == "127.0.0.1"
    assert PrefillConfig().host == "127.0.0.1"
    assert DecodeConfig().host == "127.0.0.1"
    assert GatewayConfig().host == "127.0.0.1"
    assert GatewayConfig().control_bind.startswith("tcp://127.0.0.1:")
    import argparse
    import importlib
    for mod in ("scd_serve.prefill.main", "scd_serve.decode.main", "scd_serve.gateway.main"):
        p = argparse.ArgumentParser()
        importlib.import_module(mod).add_arguments(p)
        assert p.get_default("host") == "127.0.0.1", mod
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    published = {name: svc.get("ports", []) for name, svc in compose["services"].items() if svc.get("ports")}
    # the opt-in monitoring profile also publishes its UIs, on loopback too
    roles = {name for name in published if "profiles" not in compose["services"][name]}
    assert roles == {"gateway"}, published
    assert all(str(p).startswith("127.0.0.1:") for ports in published.values() for p in ports)


async def test_k7_prompt_and_output_never_logged_at_info(make_stack, caplog):
    stack, base = await make_stack()
    caplog.set_level(logging.INFO)
    secret = "PROMPT-SECRET-7f3a"
    texts = []
    for method, stream in [("identity", False), ("local", False), ("identity", True)]:
        r = await stack.client.post("/v1/completions", json=completion(secret, 12, scd_method=method, stream=stream))
        assert r.status_code == 200
        if not stream:
            texts.append(r.json()["choices"][0]["text"])
    await stack.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": secret}],
                                                          "max_tokens": 4})
    await stack.client.post("/v1/completions", json=completion(secret, 2, temperature=-1))  # a 400 path
    await stack.client.post("/v1/completions", json=completion(secret * 100, 2))  # too long
    logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert "request_id=" in logged  # there are INFO logs to check, with ids
    assert secret not in logged
    for text in texts:
        assert len(text) >= 6 and text not in logged
    await assert_clean(stack, base)


async def test_k8_internal_error_body_has_no_traceback_or_internals(make_stack):
    stack, base = await make_stack()
    real = stack.backend.generate

    async def broken(req):
        raise RuntimeError("boom at /work/main/scd_serve/secret.py line 3: tensor([1., 2.])")
        yield

    stack.backend.generate = broken
    r = await stack.client.post("/v1/completions", json=completion("x", 2))
    assert r.status_code == 500
    err = r.json()["error"]
    assert set(err) >= {"type", "message", "request_id"}
    for leak in ("Traceback", "/work", ".py", "tensor(", "RuntimeError", "boom"):
        assert leak not in r.text, leak

    async def broken_mid_stream(req):
        async for ev in real(req):
            yield ev
            raise ValueError("mid-stream failure in /work/main/x.py tensor([3.])")

    stack.backend.generate = broken_mid_stream
    r = await stack.client.post("/v1/completions", json=completion("x", 6, stream=True))
    assert r.status_code == 200 and '"error"' in r.text and "[DONE]" in r.text
    for leak in ("Traceback", "/work", ".py", "tensor(", "ValueError"):
        assert leak not in r.text, leak
    stack.backend.generate = real
    await assert_clean(stack, base)


async def test_k9_cors_off_and_docs_can_be_disabled(make_stack):
    stack, _ = await make_stack(warm=False)
    pre = {"origin": "https://evil.example", "access-control-request-method": "POST"}
    r = await stack.client.options("/v1/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers
    r = await stack.client.post("/v1/completions", json=completion("x", 2), headers={"origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    assert (await stack.client.get("/openapi.json")).status_code == 200
    off, _ = await make_stack(warm=False, api={"enable_docs": False})
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert (await off.client.get(path)).status_code == 404, path
