"""One transfer's receive loop, run in a thread: read, verify and rebuild each chunk in turn.

The decode worker (kv_fill.py) and the bench probe both run it, so `bench ttft` times the
worker's own path. A chunk's layers are rebuilt as soon as it is verified, while later chunks
are on the wire; `drain` reads the stream's end off the path to the first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from scd_serve.errors import IncompatiblePeer, TransferCorrupt
from scd_serve.transport.chunking import StreamVerifier
from scd_serve.transport.tensors import LAST_ROW, decode_code


@dataclass
class Received:
    payload_bytes: int = 0  # code bytes received (not a last-row handoff's few: prefill/service.py)
    encode_us: int = 0  # producer time the chunks report
    rebuild_s: float = 0.0  # prepare + decode + write, summed
    first_chunk_at: float | None = None  # time.perf_counter() at each chunk's arrival
    last_chunk_at: float | None = None
    rebuilt_at: float | None = None  # the last layer written
    cache_hit: bool = False  # the producer served its code cache
    first_chunk_bytes: int = 0  # code bytes of the first chunk (the rest crossed between first and last)
    wait_s: float = 0.0  # time the reader waited for messages after the first chunk (the link's share)


def check_header(header, peer, codec) -> None:
    """A stream's header against the handshake (peer.info) and the codec decoding it: the worker
    may have been restarted with another producer or codec since."""
    if header.producer_fingerprint != peer.info.producer_fingerprint:
        raise IncompatiblePeer(f"prefill {peer.address} now runs producer {header.producer_fingerprint}, "
                               f"handshake said {peer.info.producer_fingerprint}")
    if header.codec_version != codec.version:
        raise IncompatiblePeer(f"prefill {peer.address} sent codec_version {header.codec_version}, "
                               f"this side decodes {codec.version}")


def rebuild_chunk(chunk, rebuild_layer: Callable[[int, dict], None]) -> None:
    """Every layer of one verified KVChunk: its tensors -> a code dict -> rebuild_layer."""
    for layer in range(chunk.layer_start, chunk.layer_end):
        try:
            code = decode_code(chunk.tensors, layer)
        except Exception as exc:  # malformed tensors (digest-true but ill-formed): refuse them
            raise TransferCorrupt(f"layer {layer} code could not be read: {type(exc).__name__}: {exc}") from None
        rebuild_layer(layer, code)


def receive(call: Iterable, verifier: StreamVerifier, prepare: Callable[[], None],
            rebuild_layer: Callable[[int, dict], None]) -> Received:
    """Read `call` (PrefillChunk messages) up to its last chunk; each passes the verifier before
    rebuild_layer(layer, code) decodes and writes it. Errors propagate (grpc.RpcError, ScdError)."""
    got = Received()
    t0 = time.perf_counter()
    prepare()
    waiting = time.perf_counter()
    got.rebuild_s += waiting - t0
    for msg in call:
        now = time.perf_counter()
        if got.first_chunk_at is not None:
            got.wait_s += now - waiting
        chunk = verifier.on_message(msg)
        if chunk is None:
            waiting = time.perf_counter()
            continue
        nbytes = sum(len(t.data) for t in chunk.tensors if t.name not in LAST_ROW)  # codes only
        if got.first_chunk_at is None:
            got.first_chunk_at, got.first_chunk_bytes = now, nbytes
        got.last_chunk_at = now
        got.payload_bytes += nbytes
        got.encode_us += chunk.encode_us
        rebuild_chunk(chunk, rebuild_layer)
        got.rebuilt_at = waiting = time.perf_counter()
        got.rebuild_s += got.rebuilt_at - now
        if verifier.complete:
            break
    verifier.finish()  # every chunk must be in (else the stream ended early)
    got.cache_hit = verifier.header.cache_hit
    return got


def drain(call: Iterable) -> str:
    """The end of a stream whose transfer is complete: "" for a clean end, else what came
    instead (an extra message, an error status), to log at most: it never fails a transfer."""
    try:
        for msg in call:
            return f"unexpected {msg.WhichOneof('body') or 'empty'} message after the last chunk"
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    return ""
