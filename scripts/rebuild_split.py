#!/usr/bin/env python3
"""One prompt's rebuild by a codec against the consumer's own prefill, and the same rebuild
without its K/V writes: medians of 15, one thread, random token ids. PAIR holds producer/,
consumer/ and codebook/ (a zoo pair after scripts/zoo_eval.py).

    python scripts/rebuild_split.py PAIR METHOD TOKENS
"""

from __future__ import annotations

import argparse

import torch

from scd_serve import codec as registry
from scd_serve.bench.stats import median_s
from scd_serve.model import ModelRuntime


def main(pair: str, method: str, num_tokens: int) -> None:
    torch.set_num_threads(1)
    producer, consumer = ModelRuntime.load(f"{pair}/producer"), ModelRuntime.load(f"{pair}/consumer")
    ids = torch.randint(4, consumer.spec.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    blocks = list(range(-(-num_tokens // 16)))
    pool = consumer.new_kv_pool(len(blocks), 16)
    codec = registry.build(method, producer=producer, consumer=consumer, codebook=f"{pair}/codebook")
    first = registry.codes_from(codec, 0, num_tokens)  # after the codec's head, which the rebuild computes
    states = producer.iter_prefill(ids, compute_logits=False, residuals=True)
    codes = [codec.encode_layer(layer, state.rows_from(first)) for layer, state in states]

    def prefill() -> None:
        writer = consumer.kv_writer(pool, blocks, num_tokens)
        for layer, state in consumer.iter_prefill(ids, compute_logits=False):
            writer.write(layer, state.keys, state.values)

    def rebuild(write: bool = True) -> None:  # as the decode worker: the prompt's Rebuild, then every layer
        writer = consumer.kv_writer(pool, blocks, num_tokens)
        prompt = registry.begin(codec, ids.tolist(), consumer)
        prompt.prepare()
        for layer, code in enumerate(codes):
            k_pre, v = prompt.decode_layer(layer, code)
            if write:
                writer.write(layer, k_pre, v)

    # each after a warm call (median_s): kernels loaded, the prior's rows of the prompt's tokens known
    p, r, d = (median_s(lambda _: fn(), 15) * 1e3 for fn in (prefill, rebuild, lambda: rebuild(write=False)))
    print(f"{method} T={num_tokens} head={getattr(codec, 'head_tokens', 0)} prefill {p:.2f} ms  rebuild {r:.2f} "
          f"({r / p:.3f})  decode-only {d:.2f} ({d / p:.3f})  writes {(r - d) / p:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pair", help="a directory holding producer/, consumer/ and codebook/")
    parser.add_argument("method", help="a transfer method (scd, reuse, prior-only, ...)")
    parser.add_argument("tokens", type=int, help="the prompt's length")
    args = parser.parse_args()
    main(args.pair, args.method, args.tokens)
