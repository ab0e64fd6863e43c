"""The HTTP request's id rides the Prefill call as gRPC metadata (x-request-id), both call paths."""

from scd_serve.config.transport import TransportConfig
from scd_serve.transport.client import REQUEST_ID_KEY, PrefillClient
from scd_serve.transport.proto import pb


class Recorder:
    def __init__(self):
        self.metadata = None

    def Prefill(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.metadata = dict(metadata or ())
        return iter(())


async def test_the_prefill_call_carries_the_request_id_in_its_metadata():
    client = PrefillClient("127.0.0.1:9", TransportConfig())  # channels connect lazily: nothing dials
    try:
        client._stub, client._stream_stub = Recorder(), Recorder()
        request = pb.PrefillRequest(request_id="trace-7", token_ids=[1, 2])
        client.stream(request, timeout=5)
        client.prefill(request, timeout=5)
        assert client._stream_stub.metadata[REQUEST_ID_KEY] == "trace-7" == client._stub.metadata[REQUEST_ID_KEY]
    finally:
        await client.close()
