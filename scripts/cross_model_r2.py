#!/usr/bin/env python3
"""How much of the consumer's K/V any linear map of the producer's states can rebuild.

Per layer and stream (pre-RoPE k, v and the attention input h), the held-out R^2 (every fifth
prompt held out) of ridge maps to the consumer's rows from: the producer's same stream at the
same token (what Reuse decodes from), its attention inputs at every layer, and its same stream
at the token and the two before it. Where all three stay below 1, the rest is computed by the
consumer alone and no linear decoder of producer states can ship it.

    python scripts/cross_model_r2.py PRODUCER CONSUMER prompts.jsonl [NUM_PROMPTS]
"""

import argparse
import json

import torch

from scd_serve.model.runtime import ModelRuntime

FIELDS = {"k": "keys", "v": "values", "h": "attn_input"}


def r2(x: torch.Tensor, y: torch.Tensor, train: torch.Tensor) -> float:
    x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    gram = x[train].T @ x[train]
    lam = 1e-4 * gram.trace() / gram.shape[0]
    w = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=x.dtype), x[train].T @ y[train])
    test = ~train
    return float(1 - (x[test] @ w - y[test]).pow(2).sum() / (y[test] - y[train].mean(0)).pow(2).sum())


def main(producer: str, consumer: str, data: str, num_prompts: int = 40, per_prompt: int = 150) -> None:
    torch.set_num_threads(1)
    pa, cb = ModelRuntime.load(producer), ModelRuntime.load(consumer)
    records = [json.loads(line) for line in open(data) if line.strip()][:num_prompts]
    gen = torch.Generator().manual_seed(0)
    a: dict = {}  # (layer, stream) -> producer rows [N, 3 d] (t, t-1, t-2)
    b: dict = {}  # (layer, stream) -> consumer rows [N, d]
    prompt_of = []
    for i, rec in enumerate(records):
        ids = torch.tensor(pa.tokenizer(rec.get("prompt") or rec["text"])["input_ids"])
        t = ids.shape[0]
        idx = 2 + torch.randperm(t - 2, generator=gen)[:per_prompt]
        states = zip(pa.iter_prefill(ids, compute_logits=False), cb.iter_prefill(ids, compute_logits=False))
        for (layer, sa), (_, sb) in states:
            for s, field in FIELDS.items():
                x = getattr(sa, field).reshape(t, -1).double()
                a.setdefault((layer, s), []).append(torch.cat([x[idx], x[idx - 1], x[idx - 2]], 1))
                b.setdefault((layer, s), []).append(getattr(sb, field).reshape(t, -1)[idx].double())
        prompt_of += [i] * len(idx)
    a = {k: torch.cat(v) for k, v in a.items()}
    b = {k: torch.cat(v) for k, v in b.items()}
    train = torch.tensor(prompt_of) % 5 != 0
    layers = 1 + max(layer for layer, _ in a)
    all_h = torch.cat([a[(layer, "h")][:, : a[(layer, "h")].shape[1] // 3] for layer in range(layers)], 1)
    print("layer stream | same stream, token | h of every layer, token | same stream, token and 2 before")
    for (layer, s), x in a.items():
        d = x.shape[1] // 3
        y = b[(layer, s)]
        print(f"{layer} {s} | {r2(x[:, :d], y, train):.3f} | {r2(all_h, y, train):.3f} | {r2(x, y, train):.3f}",
              flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("producer", help="producer model directory")
    parser.add_argument("consumer", help="consumer model directory")
    parser.add_argument("data", help="JSONL of {\"prompt\"} or {\"text\"} records")
    parser.add_argument("num_prompts", type=int, nargs="?", default=40, help="first records used (default 40)")
    args = parser.parse_args()
    main(args.producer, args.consumer, args.data, args.num_prompts)
