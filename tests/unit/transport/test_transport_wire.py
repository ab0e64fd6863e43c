"""Tensor serialization, xxh64 digests and the receiver's stream checks (no sockets)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scd_serve.errors import TransferCorrupt, TransferFailed
from scd_serve.transport.chunking import chunk_digest
from scd_serve.transport.chunking import StreamVerifier, chunk_message, group_layers
from scd_serve.transport.proto import pb
from scd_serve.transport.tensors import DTYPES, decode_code, encode_code, from_proto


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_code_roundtrip_is_bit_exact(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 2, 3, generator=g) * 50).to(dtype)
    code = {"k": x, "empty": torch.zeros(0, 4, dtype=dtype)}
    back = decode_code(encode_code(3, code), layer=3)
    assert list(back) == ["k", "empty"]
    assert back["k"].dtype == dtype and back["k"].shape == x.shape
    assert torch.equal(back["k"].view(torch.uint8), x.view(torch.uint8))
    assert back["empty"].shape == (0, 4)


def test_non_transport_dtype_refused():
    with pytest.raises(ValueError, match="dtype"):
        encode_code(0, {"k": torch.zeros(2, dtype=torch.float64)})


@pytest.mark.parametrize("msg,match", [
    (pb.Tensor(name="k", dtype="float64", shape=[1], data=b"\0" * 8), "unknown dtype"),
    (pb.Tensor(name="k", dtype="float32", shape=[3], data=b"\0" * 8), "needs 12 bytes"),
    (pb.Tensor(name="k", dtype="int8", shape=[1] * 7, data=b"\0"), "rank"),
])
def test_malformed_tensor_raises_value_error(msg, match):
    with pytest.raises(ValueError, match=match):
        from_proto(msg)


def make_chunk(*args) -> pb.KVChunk:
    return chunk_message(*args).chunk


def _chunks(rid="r1", layers=3):
    tensors = [encode_code(i, {"k": torch.full((4, 2, 2), float(i))}) for i in range(layers)]
    return [make_chunk(rid, i, layers, i, i + 1, tensors[i]) for i in range(layers)]


def _verifier(rid="r1", layers=3, total=3):
    v = StreamVerifier(rid, "identity", num_tokens=4, num_layers=layers)
    v.on_header(pb.TransferHeader(request_id=rid, codec_id="identity", num_tokens=4, num_layers=layers,
                                  total_chunks=total))
    return v


def test_digest_detects_one_flipped_byte():
    chunk = _chunks()[1]
    data = bytearray(chunk.tensors[0].data)
    data[7] ^= 0x01
    chunk.tensors[0].data = bytes(data)
    assert chunk_digest(chunk) != chunk.digest
    v = _verifier()
    v.on_chunk(_chunks()[0])
    with pytest.raises(TransferCorrupt, match="xxh64"):
        v.on_chunk(chunk)


def test_stream_in_order_completes_and_duplicates_are_ignored():
    v = _verifier()
    c = _chunks()
    assert v.on_chunk(c[0]) is True
    assert v.on_chunk(c[0]) is False  # identical resend: idempotent
    assert v.on_chunk(c[1]) and v.on_chunk(c[2])
    v.finish()
    assert v.complete


@pytest.mark.parametrize("case", ["gap", "overflow", "other_request", "missing_last", "layer_range", "no_header"])
def test_stream_violations_are_rejected(case):
    c = _chunks()
    v = _verifier()
    if case == "gap":
        v.on_chunk(c[0])
        with pytest.raises(TransferCorrupt, match="gap"):
            v.on_chunk(c[2])
    elif case == "overflow":
        bad = make_chunk("r1", 3, 3, 0, 1, [])
        with pytest.raises(TransferCorrupt, match="seq=3"):
            v.on_chunk(bad)
    elif case == "other_request":
        with pytest.raises(TransferCorrupt, match="another request"):
            v.on_chunk(_chunks(rid="r2")[0])
    elif case == "missing_last":
        v.on_chunk(c[0])
        v.on_chunk(c[1])
        with pytest.raises(TransferFailed, match="2 of 3"):
            v.finish()
    elif case == "layer_range":
        with pytest.raises(TransferCorrupt, match="layers"):
            v.on_chunk(make_chunk("r1", 0, 3, 0, 4, []))
    else:
        fresh = StreamVerifier("r1", "identity", 4, 3)
        with pytest.raises(TransferCorrupt, match="before header"):
            fresh.on_chunk(c[0])


def test_an_empty_message_is_not_a_chunk():
    with pytest.raises(TransferCorrupt, match="unexpected empty message"):
        _verifier().on_message(pb.PrefillChunk())


@pytest.mark.parametrize("field,value", [("codec_id", "raw"), ("num_layers", 4), ("num_tokens", 5),
                                         ("request_id", "zz")])
def test_header_mismatch_names_the_field(field, value):
    v = StreamVerifier("r1", "identity", 4, 3)
    h = pb.TransferHeader(request_id="r1", codec_id="identity", num_tokens=4, num_layers=3, total_chunks=3)
    setattr(h, field, value)
    with pytest.raises(TransferCorrupt, match=field):
        v.on_header(h)


def test_group_layers_bounds_chunk_bytes():
    layers = [encode_code(i, {"k": torch.zeros(n, dtype=torch.uint8)}) for i, n in enumerate([10, 10, 30, 5, 5])]
    assert group_layers(layers, 20) == [(0, 2), (2, 3), (3, 5)]
    assert group_layers(layers, 1) == [(i, i + 1) for i in range(5)]


def test_group_layers_keep_ends_packs_only_the_layers_between():
    sizes = [8, 8, 8, 8, 64, 8, 12, 8]  # the demo pair's scd code per layer, in KB
    layers = [encode_code(i, {"k": torch.zeros(n, dtype=torch.uint8)}) for i, n in enumerate(sizes)]
    assert group_layers(layers, 32, keep_ends=True) == [(0, 1), (1, 4), (4, 5), (5, 7), (7, 8)]
    assert group_layers(layers, 1 << 20, keep_ends=True) == [(0, 1), (1, 7), (7, 8)]
    assert group_layers(layers, 1, keep_ends=True) == [(i, i + 1) for i in range(8)]
    assert group_layers(layers[:2], 1 << 20, keep_ends=True) == [(0, 2)]  # nothing between to pack
    assert group_layers(layers[:1], 1 << 20, keep_ends=True) == [(0, 1)]


def _with_header(rid="r1", layers=3, total=3, seq=0):
    tensors = encode_code(seq, {"k": torch.full((4, 2, 2), float(seq))})
    h = pb.TransferHeader(request_id=rid, codec_id="identity", num_tokens=4, num_layers=layers, total_chunks=total)
    return h, chunk_message(rid, seq, total, seq, seq + 1, tensors, header=h)


def test_header_inside_chunk_zero_is_checked_first_and_resends_are_ignored():
    seen = []
    v = StreamVerifier("r1", "identity", 4, 3, check_header=seen.append)
    h, first = _with_header()
    assert first.WhichOneof("body") == "chunk" and first.chunk.HasField("header")
    chunk = v.on_message(first)
    assert chunk is not None and chunk.seq == 0 and v.header == h and seen == [h]
    assert v.on_message(first) is None  # an identical resend of chunk 0 (header and all)
    c = _chunks()
    assert v.on_message(pb.PrefillChunk(chunk=c[1])).seq == 1
    assert v.on_message(pb.PrefillChunk(chunk=c[2])).seq == 2
    v.finish()


@pytest.mark.parametrize("case", ["header_on_seq_1", "second_different_header", "bad_header", "refused_by_caller"])
def test_header_inside_a_chunk_violations(case):
    v = StreamVerifier("r1", "identity", 4, 3)
    if case == "header_on_seq_1":
        v.on_message(_with_header()[1])
        with pytest.raises(TransferCorrupt, match="carries a header"):
            v.on_message(_with_header(seq=1)[1])
    elif case == "second_different_header":
        v.on_message(pb.PrefillChunk(header=pb.TransferHeader(request_id="r1", codec_id="identity", num_tokens=4,
                                                              num_layers=3, total_chunks=2)))
        with pytest.raises(TransferCorrupt, match="second, different header"):
            v.on_message(_with_header()[1])
    elif case == "bad_header":
        msg = _with_header()[1]
        msg.chunk.header.num_tokens = 5
        with pytest.raises(TransferCorrupt, match="num_tokens"):
            v.on_message(msg)
    else:
        def refuse(header):
            raise TransferCorrupt("caller says no")
        v = StreamVerifier("r1", "identity", 4, 3, check_header=refuse)
        with pytest.raises(TransferCorrupt, match="caller says no"):
            v.on_message(_with_header()[1])
        assert v.header is None and v.next_seq == 0  # nothing accepted



@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_fuzz_random_bytes_never_crash_the_receiver(data):
    """B7: garbage -> DecodeError/ValueError (or a clean TransferCorrupt), nothing else."""
    from google.protobuf.message import DecodeError

    try:
        chunk = pb.KVChunk.FromString(data)
    except DecodeError:
        return
    v = _verifier(rid=chunk.request_id or "r1")
    try:
        if v.on_chunk(chunk):
            for layer in range(chunk.layer_start, chunk.layer_end):
                decode_code(chunk.tensors, layer)
    except (TransferCorrupt, ValueError):
        pass
