"""Rebuild time of each transfer method against the consumer's own prefill, same prompt length.

Rebuild = the codec's prompt-only prepare + decode_layer and the KV write of every layer;
prefill = the consumer's layer-wise prefill + write_kv (the oracle). Medians of --repeat.
--cold: a freshly loaded codec per rebuild, so no token's rows are kept from an earlier
prompt (tokens the worker never saw). --prior-table: the decode worker's vocabulary table of
the token prior first (timed apart), after which no prompt computes its tokens' rows.
"""

from __future__ import annotations

import argparse

import torch

from scd_serve import codec as registry
from scd_serve.bench.stats import median_s


def main(argv: list[str] | None = None) -> int:
    from scd_serve.model import ModelRuntime

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--producer", required=True)
    p.add_argument("--consumer", required=True)
    p.add_argument("--codebook", default=None)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cold", action="store_true", help="a fresh codec per rebuild: no token kept from earlier prompts")
    p.add_argument("--prior-table", action="store_true", help="the token prior's vocabulary table, made before timing")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rt_a, rt_b = ModelRuntime.load(args.producer), ModelRuntime.load(args.consumer)
    ids = torch.randint(4, rt_b.spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    blocks = list(range(-(-args.tokens // 16)))
    pool = rt_b.new_kv_pool(len(blocks), 16)
    states = [s for _, s in rt_a.iter_prefill(ids, compute_logits=False, residuals=True)]  # any plan encodes

    def prefill(_=None):
        for layer, s in rt_b.iter_prefill(ids, compute_logits=False):
            rt_b.write_kv(pool, blocks, layer, s.keys, s.values)

    book = _with_table(args.codebook, rt_b) if args.prior_table and args.codebook else args.codebook
    base = median_s(prefill, args.repeat)
    print(f"consumer prefill of {args.tokens} tokens: {base * 1e3:.1f} ms")
    print(f"{'method':<12}{'rebuild ms':>12}{'vs prefill':>12}")
    for method in registry.METHODS:
        if method in registry.NEEDS_CODEBOOK and args.codebook is None:
            continue

        def build(method=method):
            return registry.build(method, producer=rt_a, consumer=rt_b, codebook=book)

        c = build()
        first = registry.codes_from(c, 0, args.tokens)  # after the codec's head, computed in the rebuild
        codes = [c.encode_layer(i, s.rows_from(first)) for i, s in enumerate(states)]

        def rebuild(fresh, c=c, codes=codes):  # as the decode worker: prepare once, then every layer
            c = fresh if fresh is not None else c
            writer = rt_b.kv_writer(pool, blocks, args.tokens)
            prompt = registry.begin(c, ids.tolist(), rt_b)
            prompt.prepare()
            for layer, code in enumerate(codes):
                k, v = prompt.decode_layer(layer, code)
                writer.write(layer, k, v)

        t = median_s(rebuild, args.repeat, build if args.cold else lambda: None)
        print(f"{method:<12}{t * 1e3:>12.1f}{t / base:>12.3f}")
    return 0


def _with_table(directory: str, consumer):
    """The codebook, loaded once, its feature prior holding the vocabulary table: every codec
    built from it (a fresh one per rebuild with --cold) reads the table, as on a worker."""
    from scd_serve.codec import prior_table
    from scd_serve.codec.codebook import Codebook

    book = Codebook.load(directory, consumer=consumer)
    if said := prior_table.fill_codebook(book, consumer, "on"):
        print(said)
    return book


if __name__ == "__main__":
    raise SystemExit(main())
