"""decode/receive.py against scripted streams: verify before rebuild, return at the last
chunk without reading the stream's end, and drain that end without failing the transfer."""

import grpc
import pytest
import torch

from scd_serve.decode.receive import drain, receive
from scd_serve.errors import TransferCorrupt, TransferFailed
from scd_serve.transport.chunking import StreamVerifier, chunk_message
from scd_serve.transport.proto import pb
from scd_serve.transport.status import rpc_error
from scd_serve.transport.tensors import encode_code


class Stream:
    """A blocking call's stand-in: yields messages, then ends with `end` (None = OK)."""

    def __init__(self, msgs, end=None):
        self.msgs, self.end, self.read = list(msgs), end, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.read < len(self.msgs):
            self.read += 1
            return self.msgs[self.read - 1]
        self.read += 1
        if self.end is not None:
            raise self.end
        raise StopIteration


def messages(layers=3, flip=None):
    header = pb.TransferHeader(request_id="r", codec_id="identity", num_tokens=2, num_layers=layers,
                               total_chunks=layers)
    out = []
    for i in range(layers):
        tensors = encode_code(i, {"k": torch.full((2, 1, 4), float(i)), "v": torch.zeros(2, 1, 4)})
        msg = chunk_message("r", i, layers, i, i + 1, tensors, header=header if i == 0 else None)
        if i == flip:
            msg.chunk.tensors[0].data = b"\x00" * len(msg.chunk.tensors[0].data)
        out.append(msg)
    return out


def run(stream, layers=3):
    built = []
    got = receive(stream, StreamVerifier("r", "identity", 2, layers), lambda: built.append("prepare"),
                  lambda layer, code: built.append((layer, float(code["k"][0, 0, 0]))))
    return got, built


def test_rebuilds_each_layer_in_order_and_returns_at_the_last_chunk():
    stream = Stream(messages(), end=rpc_error(grpc.StatusCode.INTERNAL, "late failure"))
    got, built = run(stream)
    assert built == ["prepare", (0, 0.0), (1, 1.0), (2, 2.0)]
    assert stream.read == 3  # the stream's end was not read on the way to the first token
    assert got.payload_bytes > 0 and got.first_chunk_at <= got.last_chunk_at <= got.rebuilt_at
    assert drain(stream) == "INTERNAL: late failure"  # reported, never raised


def test_drain_of_a_clean_end_is_empty_and_an_extra_message_is_named():
    stream = Stream(messages())
    run(stream)
    assert drain(stream) == ""
    extra = Stream(messages() + [pb.PrefillChunk()])
    run(extra)
    assert drain(extra) == "unexpected empty message after the last chunk"


def test_a_corrupt_chunk_is_refused_before_its_layer_is_rebuilt():
    with pytest.raises(TransferCorrupt, match="xxh64"):
        run(Stream(messages(flip=1)))


def test_a_stream_that_ends_early_fails_and_an_error_status_propagates():
    with pytest.raises(TransferFailed, match="after 2 of 3 chunks"):
        run(Stream(messages()[:2]))
    with pytest.raises(grpc.RpcError):
        run(Stream(messages()[:1], end=rpc_error(grpc.StatusCode.UNAVAILABLE, "gone")))
