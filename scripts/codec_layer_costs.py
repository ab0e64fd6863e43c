"""One layer's transfer costs, each part timed alone (medians of --runs): the producer's encode and
protobuf packing, the stream's digest and unpacking, the decode side's decode and pool write.
Random keys and values of the model's shape stand in for a prompt's (what is timed does not
depend on them). One thread, pinned, as the decode worker's transfer threads run:

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python scripts/codec_layer_costs.py --model out/shaped/consumer
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scd_serve.codec import build
from scd_serve.model.runtime import ModelRuntime
from scd_serve.transport.chunking import chunk_digest, chunk_message
from scd_serve.transport.tensors import decode_code, encode_code


def median_ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="producer and consumer both (a codec without a codebook)")
    p.add_argument("--method", default="raw", choices=("raw", "identity", "quant4"))
    p.add_argument("--tokens", type=int, default=1023)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    rt = ModelRuntime.load(args.model, dtype=args.dtype)
    spec, layer, n = rt.spec, 1, args.tokens
    codec = build(args.method, producer=rt, consumer=rt)
    g = torch.Generator().manual_seed(0)
    # k, v: [tokens, kv_heads, head_dim], keys before RoPE
    state = {"keys": torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=g).to(rt.dtype),
             "values": torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=g).to(rt.dtype)}
    blocks = list(range(n // 16 + 1))
    writer = rt.kv_writer(rt.new_kv_pool(len(blocks), 16), blocks, n)
    with torch.inference_mode():
        code = codec.encode_layer(layer, state)
        msg = chunk_message("r", 0, 1, layer, layer + 1, encode_code(layer, code))
        received = decode_code(msg.chunk.tensors, layer)
        k, v = codec.decode_layer(layer, received, rt, start=0)
        parts = {"encode (producer)": lambda: codec.encode_layer(layer, state),
                 "to protobuf (producer)": lambda: encode_code(layer, code),
                 "digest (decode side)": lambda: chunk_digest(msg.chunk),
                 "from protobuf (decode side)": lambda: decode_code(msg.chunk.tensors, layer),
                 "decode_layer (decode side)": lambda: codec.decode_layer(layer, received, rt, start=0),
                 "pool write, keys rotated (decode side)": lambda: writer.write(layer, k, v)}
        print(f"{args.method}, {n} tokens, {args.dtype}, {torch.get_num_threads()} thread(s), ms a layer:")
        for name, fn in parts.items():
            print(f"  {name:40s} {median_ms(fn, args.runs):7.3f}")


if __name__ == "__main__":
    main()
