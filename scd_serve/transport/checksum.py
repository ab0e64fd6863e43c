"""xxh64 digest of a KVChunk: covers identity, position and every tensor byte.

The digest is computed over a canonical field order rather than SerializeToString()
because protobuf serialization is not guaranteed to be deterministic across versions.
"""

from __future__ import annotations

import struct

import xxhash


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
    """Set chunk.digest in place and return the chunk."""
    chunk.digest = chunk_digest(chunk)
    return chunk
