"""Chunks of a transfer: built on the prefill side, verified on the decode side.

`StreamVerifier` (plain Python) checks the header against what was asked and each chunk's
request id, position, layer range and digest BEFORE anything is decoded. Identical resends
are ignored; gaps, overflow and bad digests end the transfer with TransferCorrupt. The
header comes alone or inside chunk 0 (a cache hit). The xxh64 digest covers a chunk's
identity, position and every tensor byte in a canonical field order, not SerializeToString()'s:
protobuf serialization is not guaranteed to be deterministic across versions.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from scd_serve.errors import TransferCorrupt, TransferFailed
from scd_serve.transport.proto import pb


def chunk_digest(chunk) -> int:
    """xxh64 (seed 0) of request_id, seq, total, layer range and all tensors, in order."""
    h = xxhash.xxh64(seed=0)
    rid = chunk.request_id.encode()
    h.update(struct.pack("<I", len(rid)) + rid)
    h.update(struct.pack("<IIII", chunk.seq, chunk.total, chunk.layer_start, chunk.layer_end))
    for t in chunk.tensors:
        name, dtype = t.name.encode(), t.dtype.encode()
        h.update(struct.pack("<III", t.layer, len(name), len(dtype)) + name + dtype)
        h.update(struct.pack("<I", len(t.shape)) + struct.pack(f"<{len(t.shape)}Q", *t.shape))
        h.update(struct.pack("<Q", len(t.data)))
        h.update(t.data)
    return h.intdigest()


def seal(chunk):
    chunk.digest = chunk_digest(chunk)
    return chunk


def chunk_message(request_id: str, seq: int, total: int, layer_start: int, layer_end: int, tensors: list,
                  encode_us: int = 0, header: pb.TransferHeader | None = None) -> pb.PrefillChunk:
    """A sealed chunk built in place inside its stream message (one copy of the tensor bytes,
    not one into the chunk and another into the message); `header` only with seq 0."""
    msg = pb.PrefillChunk()
    chunk = msg.chunk
    chunk.request_id, chunk.seq, chunk.total = request_id, seq, total
    chunk.layer_start, chunk.layer_end, chunk.encode_us = layer_start, layer_end, encode_us
    chunk.tensors.extend(tensors)
    if header is not None:
        chunk.header.CopyFrom(header)
    seal(chunk)
    return msg


def group_layers(layer_tensors: list[list], max_bytes: int, keep_ends: bool = False) -> list[tuple[int, int]]:
    """Split layers into contiguous ranges of at most max_bytes of code each (>= 1 layer).
    keep_ends (three layers or more): the first and the last layer go alone whatever their
    size, so the receiver starts rebuilding after one layer's bytes and has one layer left
    after the last byte; only the layers between are packed (config/prefill.py: chunk_bytes)."""
    if keep_ends and len(layer_tensors) > 2:
        middle = group_layers(layer_tensors[1:-1], max_bytes)
        last = len(layer_tensors) - 1
        return [(0, 1)] + [(a + 1, b + 1) for a, b in middle] + [(last, last + 1)]
    ranges, start, size = [], 0, 0
    for layer, tensors in enumerate(layer_tensors):
        n = sum(len(t.data) for t in tensors)
        if layer > start and size + n > max_bytes:
            ranges.append((start, layer))
            start, size = layer, 0
        size += n
    if layer_tensors:
        ranges.append((start, len(layer_tensors)))
    return ranges


@dataclass
class StreamVerifier:
    """Receiver-side checks for one Prefill stream."""

    request_id: str
    method: str
    num_tokens: int
    num_layers: int
    # The caller's own checks on the header (producer, codec version), run as soon as the
    # header is in, before any chunk is accepted; raise to refuse the stream.
    check_header: Callable[[pb.TransferHeader], None] | None = None
    header: pb.TransferHeader | None = None
    next_seq: int = 0
    next_layer: int = 0
    digests: dict[int, int] = field(default_factory=dict)

    def on_header(self, header: pb.TransferHeader) -> None:
        if self.header is not None:
            raise TransferCorrupt(f"request {self.request_id}: second header in one stream")
        want = {"request_id": self.request_id, "codec_id": self.method,
                "num_tokens": self.num_tokens, "num_layers": self.num_layers}
        for name, value in want.items():
            if getattr(header, name) != value:
                raise TransferCorrupt(f"request {self.request_id}: header {name}={getattr(header, name)!r}, "
                                      f"expected {value!r}")
        if not 1 <= header.total_chunks <= self.num_layers:
            raise TransferCorrupt(f"request {self.request_id}: header total_chunks={header.total_chunks} "
                                  f"not in [1, {self.num_layers}]")
        if self.check_header is not None:
            self.check_header(header)
        self.header = header

    def on_message(self, msg: pb.PrefillChunk) -> pb.KVChunk | None:
        """One stream message -> its chunk if new and verified; None for a header alone or an
        identical duplicate. The header inside chunk 0 is checked before the chunk."""
        body = msg.WhichOneof("body")
        if body == "header":
            self.on_header(msg.header)
            return None
        if body != "chunk":
            raise TransferCorrupt(f"request {self.request_id}: unexpected {body or 'empty'} message in the stream")
        chunk = msg.chunk
        if chunk.HasField("header"):
            if chunk.seq != 0:
                raise TransferCorrupt(f"request {self.request_id}: chunk {chunk.seq} carries a header; "
                                      f"only chunk 0 may")
            if self.header is None:
                self.on_header(chunk.header)
            elif chunk.header != self.header:  # a resent chunk 0 must repeat the same header
                raise TransferCorrupt(f"request {self.request_id}: second, different header in chunk 0")
        return chunk if self.on_chunk(chunk) else None

    def on_chunk(self, chunk: pb.KVChunk) -> bool:
        """True if the chunk is new and verified; False for an identical duplicate."""
        rid = self.request_id
        if self.header is None:
            raise TransferCorrupt(f"request {rid}: chunk before header")
        if chunk.request_id != rid:
            raise TransferCorrupt(f"request {rid}: chunk for another request {chunk.request_id!r}")
        total = self.header.total_chunks
        if chunk.total != total or chunk.seq >= total:
            raise TransferCorrupt(f"request {rid}: chunk seq={chunk.seq} total={chunk.total}, header total={total}")
        digest = chunk_digest(chunk)
        if digest != chunk.digest:
            raise TransferCorrupt(f"request {rid}: chunk {chunk.seq} failed its xxh64 check "
                                  f"(got {chunk.digest:016x}, computed {digest:016x})")
        if chunk.seq < self.next_seq:  # a resend: harmless if it is the same chunk
            if self.digests.get(chunk.seq) != digest:
                raise TransferCorrupt(f"request {rid}: chunk {chunk.seq} sent twice with different content")
            return False
        if chunk.seq > self.next_seq:
            raise TransferCorrupt(f"request {rid}: chunk {chunk.seq} arrived, expected {self.next_seq} (gap)")
        if chunk.layer_start != self.next_layer or not (chunk.layer_start < chunk.layer_end <= self.num_layers):
            raise TransferCorrupt(f"request {rid}: chunk {chunk.seq} covers layers [{chunk.layer_start}, "
                                  f"{chunk.layer_end}), expected to start at {self.next_layer} "
                                  f"and end <= {self.num_layers}")
        for t in chunk.tensors:
            if not chunk.layer_start <= t.layer < chunk.layer_end:
                raise TransferCorrupt(f"request {rid}: chunk {chunk.seq} holds tensor of layer {t.layer}")
        self.digests[chunk.seq] = digest
        self.next_seq += 1
        self.next_layer = chunk.layer_end
        return True

    @property
    def complete(self) -> bool:
        return self.header is not None and self.next_seq == self.header.total_chunks \
            and self.next_layer == self.num_layers

    def finish(self) -> None:
        """Call when the stream ends: every chunk must have arrived."""
        if not self.complete:
            got = self.next_seq
            want = self.header.total_chunks if self.header else "?"
            raise TransferFailed(f"request {self.request_id}: stream ended after {got} of {want} chunks")
