"""B1/B5/K3/K4: handshake refuses mismatches by field; message caps, worker token and mTLS."""

import asyncio
import dataclasses

import grpc
import pytest
import trustme

from scd_serve.config.transport import TransportConfig
from scd_serve.decode.backend import DecodeBackend
from scd_serve.errors import Unavailable
from scd_serve.transport.client import PrefillClient
from scd_serve.transport.proto import pb

from polls import eventually
from serving_helpers import engine_for, greedy, make_decode, start_prefill, tiny_runtime

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def rt3(tmp_path_factory):
    return tiny_runtime(tmp_path_factory.mktemp("tiny3"), num_hidden_layers=3)


async def test_layer_count_mismatch_is_refused_and_never_called(rt, rt3):
    node = await start_prefill(rt3)
    peers, fill = await make_decode(rt, [node.address], fallback="none")
    engine = engine_for(rt)
    try:
        assert not peers.ready()
        assert "num_layers: producer 3 != consumer 2" in peers.why_not_ready()
        backend = DecodeBackend(engine, "tiny", fill, peers, "identity")
        assert not backend.ready()  # the refused peer, named by peers.why_not_ready() above
        assert DecodeBackend(engine, "tiny", fill, peers, "local").ready()  # no transfer needed
        # with a local fallback the worker serves on its own, and says so
        peers.config = dataclasses.replace(peers.config, fallback="local")
        fallback = DecodeBackend(engine, "tiny", fill, peers, "identity")
        assert fallback.ready()
        detail = fallback.ready_detail()
        assert "fallback local" in detail["prefill"] and "num_layers" in detail["prefill_peers"][node.address]
        with pytest.raises(Unavailable, match="no ready prefill worker"):
            await greedy(engine, "r", [1, 2, 3], "identity", fill)
        assert node.servicer.num_prefills == 0 and node.servicer.num_served == 0
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await node.stop()


@pytest.mark.parametrize("case", ["codec_version", "producer_fingerprint", "method"])
async def test_codec_and_fingerprint_mismatch_names_the_field(rt, case):
    node = await start_prefill(rt)
    cfg = {}
    if case == "codec_version":
        type(node.servicer.codecs["identity"])  # the prefill side claims another version
        node.servicer.codecs["identity"] = type("C", (), {"version": "identity/99", "name": "identity"})()
    elif case == "producer_fingerprint":
        cfg = {"expect_producer": "llama-0000000000000000"}
    method = "raw" if case == "method" else "identity"
    peers, _ = await make_decode(rt, [node.address], method=method, **cfg)
    try:
        assert not peers.ready()
        assert case.split("_")[0] in peers.why_not_ready()
        # the escape hatch accepts it (with a warning)
        loose, _ = await make_decode(rt, [node.address], method=method, allow_incompatible=True, **cfg)
        assert loose.ready()
        await loose.close()
    finally:
        await peers.close()
        await node.stop()


async def test_reconnect_after_restart_makes_peer_ready_again(rt):
    node = await start_prefill(rt)
    peers, _ = await make_decode(rt, [node.address], health_period_s=0.1)
    port = int(node.address.rsplit(":", 1)[1])
    try:
        assert peers.ready()
        await node.stop()
        await peers.check_all()
        assert peers.ready()  # one missed check is tolerated (a slow answer under load)
        await peers.check_all()
        assert not peers.ready() and "health check failed" in peers.why_not_ready()
        await peers.check_all()
        assert "unreachable" in peers.why_not_ready()
        node = await start_prefill(rt, port=port)  # restarted on the same address
        async def check_ready():
            await peers.check_all()
            return peers.ready()

        # the channel reconnects with backoff (<= 2 s), + room for a loaded machine
        assert await eventually(check_ready, 15.0, step=0.1), peers.why_not_ready()
    finally:
        await peers.close()
        await node.stop()


async def test_message_over_the_cap_is_resource_exhausted(rt):
    node = await start_prefill(rt, transport=TransportConfig(max_message_bytes=4096), chunk_bytes=1024)
    client = PrefillClient(node.address, TransportConfig(max_message_bytes=4096))
    try:
        call = client.prefill(pb.PrefillRequest(request_id="big", token_ids=[1] * 100, method="identity"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_message_bytes" in e.value.details()
        # and a request itself over the cap is refused by the server's receive limit
        call = client.prefill(pb.PrefillRequest(request_id="huge", token_ids=[200] * 3000, method="identity"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await client.serving()
        assert node.servicer.transfers == {}
    finally:
        await client.close()
        await node.stop()


async def test_worker_token_required_before_any_work(rt):
    node = await start_prefill(rt, transport=TransportConfig(worker_token="s3cret-token"))
    anon = PrefillClient(node.address, TransportConfig())
    wrong = PrefillClient(node.address, TransportConfig(worker_token="s3cret-tokenX"))
    good = PrefillClient(node.address, TransportConfig(worker_token="s3cret-token"))
    try:
        for client in (anon, wrong):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.info()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call = client.prefill(pb.PrefillRequest(request_id="t", token_ids=[1, 2], method="identity"), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert node.servicer.num_prefills == 0
        assert await anon.serving()  # health stays open for probes
        assert (await good.info()).num_layers == 2
    finally:
        for c in (anon, wrong, good):
            await c.close()
        await node.stop()


async def test_mutual_tls(rt, tmp_path):
    ca, other = trustme.CA(), trustme.CA()
    server_cert = ca.issue_cert("localhost", "127.0.0.1")
    client_cert, rogue_cert = ca.issue_cert("decode"), other.issue_cert("decode")
    paths = {}
    for name, blob in [("ca", ca.cert_pem), ("s_cert", server_cert.cert_chain_pems[0]),
                       ("s_key", server_cert.private_key_pem), ("c_cert", client_cert.cert_chain_pems[0]),
                       ("c_key", client_cert.private_key_pem), ("r_cert", rogue_cert.cert_chain_pems[0]),
                       ("r_key", rogue_cert.private_key_pem)]:
        paths[name] = str(tmp_path / f"{name}.pem")
        blob.write_to_path(paths[name])
    node = await start_prefill(rt, transport=TransportConfig(tls_cert=paths["s_cert"], tls_key=paths["s_key"],
                                                             tls_ca=paths["ca"]))
    plain = PrefillClient(node.address, TransportConfig(rpc_timeout_s=1))
    rogue = PrefillClient(node.address, TransportConfig(rpc_timeout_s=1, tls_ca=paths["ca"], tls_cert=paths["r_cert"],
                                                        tls_key=paths["r_key"]))
    good = PrefillClient(node.address, TransportConfig(tls_ca=paths["ca"], tls_cert=paths["c_cert"],
                                                       tls_key=paths["c_key"]))
    try:
        for client in (plain, rogue):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.info()
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert (await good.info()).num_layers == 2
    finally:
        for c in (plain, rogue, good):
            await c.close()
        await node.stop()


async def test_decode_transfers_through_a_token_protected_worker(rt):
    """The token rides on the Prefill stream too, not only on unary calls."""
    transport = TransportConfig(worker_token="s3cret-token")
    node = await start_prefill(rt, transport=transport)
    peers, fill = await make_decode(rt, [node.address], transport=transport)
    engine = engine_for(rt)
    try:
        assert peers.ready(), peers.why_not_ready()
        assert await greedy(engine, "t", [3, 4, 5, 6], "identity", fill) == await greedy(engine, "l", [3, 4, 5, 6])
        assert fill.stats.num_transfers == 1
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await node.stop()


async def test_strict_deadlines_refuse_a_call_without_timeout(rt):
    node = await start_prefill(rt)
    client = PrefillClient(node.address, TransportConfig(), strict_deadlines=True)
    try:
        with pytest.raises(ValueError, match="without a deadline"):
            await client._stub.Info(pb.InfoRequest())
        with pytest.raises(ValueError, match="without a deadline"):
            call = client._stub.Prefill(pb.PrefillRequest(request_id="n", token_ids=[1], method="identity"))
            await call.read()
        assert (await client.info()).num_layers == 2  # the client's own calls always set one
    finally:
        await client.close()
        await node.stop()


async def test_garbage_bytes_on_the_grpc_port_leave_it_serving(rt):
    node = await start_prefill(rt)
    client = PrefillClient(node.address, TransportConfig())
    try:
        host, port = node.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 8)
        await writer.drain()
        closed = await asyncio.wait_for(reader.read(), 5)  # the server closes the connection
        assert isinstance(closed, bytes)
        writer.close()
        assert await client.serving()
        assert (await client.info()).num_layers == 2
    finally:
        await client.close()
        await node.stop()
