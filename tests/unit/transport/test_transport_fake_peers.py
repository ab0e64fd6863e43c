"""The in-process fake transport drives the real decode path; registry updates add/drop peers."""

import pytest
from scd_serve.testing.fake_transport import FakePrefillClient

from scd_serve import codec as codec_registry
from scd_serve.config.decode import DecodeConfig
from scd_serve.config.prefill import PrefillConfig
from scd_serve.decode.consumer_codecs import ConsumerCodecs
from scd_serve.decode.peers import PeerSet
from scd_serve.model.runtime import ModelRuntime
from scd_serve.model.tiny import save_tiny_model
from scd_serve.prefill.service import PrefillServicer
from scd_serve.transport.chunking import StreamVerifier
from scd_serve.transport.proto import pb


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    return ModelRuntime.load(save_tiny_model(tmp_path_factory.mktemp("m"), "llama"))


def servicer(rt):
    return PrefillServicer(rt, {"identity": codec_registry.build("identity", producer=rt)},
                           PrefillConfig(model="unused"))


async def test_fake_client_streams_verified_chunks_and_counts_calls(rt):
    client = FakePrefillClient(servicer(rt))
    call = client.prefill(pb.PrefillRequest(request_id="f1", token_ids=[1, 2, 3], method="identity"), timeout=5)
    v = StreamVerifier("f1", "identity", 3, rt.spec.num_layers)
    async for msg in call:
        if msg.WhichOneof("body") == "header":
            v.on_header(msg.header)
        else:
            assert v.on_chunk(msg.chunk)
    v.finish()
    assert client.num_prefill_calls == 1 and client.timeouts == [5]
    assert client.servicer.transfers == {} and client.servicer.num_served == 1


async def test_registry_peer_list_adds_handshakes_and_drops(rt):
    fakes = {}

    def factory(address):
        fakes[address] = FakePrefillClient(servicer(rt), address)
        return fakes[address]

    peers = PeerSet(rt, ConsumerCodecs(rt), DecodeConfig(model="unused", codebook="", method="identity"),
                    client_factory=factory)
    try:
        peers.update_from_registry([{"role": "prefill", "address": "10.0.0.1:1", "ready": True, "load": {"running": 3}},
                                    {"role": "decode", "address": "10.0.0.2:1", "ready": True, "load": {}}])
        await peers.check_all()
        assert list(peers.peers) == ["10.0.0.1:1"] and peers.ready()
        assert peers.choose("identity", 4).load == {"running": 3}
        fakes["10.0.0.1:1"].up = False  # it dies: one missed check is tolerated, two mark it down
        await peers.check_all()
        assert peers.ready()
        await peers.check_all()
        assert not peers.ready() and "health check failed" in peers.why_not_ready()
        peers.update_from_registry([])  # the registry dropped it
        assert peers.peers == {} and not peers.ready()
    finally:
        await peers.close()
