#!/usr/bin/env python3
"""Rows weighed by the attention they receive, against rows weighed alike: what each does to the
maps calibration fits (calibration/attention.py).

Per layer above 0, a full-rank ridge map from the producer's attention input and the consumer's
own layer-0 inputs of the token and the two before it to the consumer's K/V (rebuild_ceiling.py's
`h+prior`), fitted four ways: every row of the calibration texts alike (`plain`) or weighed by the
attention the consumer's queries give it (`weighted`), and on 41 rows a prompt sampled at random
as calibration samples them (`plain-sub`, `weighted-sub`). Each held-out text's first half is
rebuilt (layer 0 exact) and its next tokens scored against the consumer's own prefill (KL per
token, top-1 agreement), as `scd-serve eval` scores a text.

    python scripts/attention_weight_study.py PAIR_DIR [NUM_FIT] [NUM_HELD] [SCORED]

PAIR_DIR holds producer/, consumer/ and eval/ (calibration.jsonl and heldout.jsonl of {"text"}).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rebuild_ceiling import Ridge, lagged, pair_arguments, print_totals, states, tally, texts  # noqa: E402

from scd_serve.calibration.attention import received_attention  # noqa: E402
from scd_serve.model.runtime import ModelRuntime  # noqa: E402

ROWS_PER_PROMPT = 41  # calibration's 8,192 rows over 200 prompts
KINDS = ("plain", "weighted", "plain-sub", "weighted-sub")


def main(pair: str, num_fit: int, num_held: int, scored: int) -> None:
    torch.set_num_threads(1)
    root = Path(pair)
    rt_a, rt_b = ModelRuntime.load(root / "producer"), ModelRuntime.load(root / "consumer")
    spec, tok = rt_b.spec, rt_b.tokenizer
    n, kvh, hd = spec.num_layers, spec.num_kv_heads, spec.head_dim
    fits = {(kind, layer): Ridge() for kind in KINDS for layer in range(1, n)}
    gen = torch.Generator().manual_seed(0)

    def inputs(sa, eb, layer):  # [T, hidden + 3 hidden]
        return torch.cat([sa[layer].attn_input, lagged(eb)], 1)

    with torch.no_grad():
        for text in texts(root / "eval" / "calibration.jsonl", num_fit):
            ids = torch.tensor(tok(text)["input_ids"])
            sa, sb = states(rt_a, ids), states(rt_b, ids)
            eb = sb[0].attn_input
            sample = torch.randperm(len(ids), generator=gen)[:ROWS_PER_PROMPT]
            for layer in range(1, n):
                x, w = inputs(sa, eb, layer), received_attention(rt_b, layer, sb[layer].keys, sb[layer].attn_input, gen)
                y = torch.cat([sb[layer].keys.reshape(len(ids), -1), sb[layer].values.reshape(len(ids), -1)], 1)
                fits[("plain", layer)].add(x, y)
                fits[("weighted", layer)].add(x, y, w)
                fits[("plain-sub", layer)].add(x[sample], y[sample])
                fits[("weighted-sub", layer)].add(x[sample], y[sample], w[sample])
        maps = {key: r.solve() for key, r in fits.items()}
        totals = {kind: [0.0, 0.0, 0] for kind in KINDS}
        for text in texts(root / "eval" / "heldout.jsonl", num_held):
            ids = torch.tensor(tok(text)["input_ids"])
            half = ids.shape[0] // 2
            prefix, feed = ids[:half], ids[half: half + scored]
            sa, sb = states(rt_a, prefix), states(rt_b, prefix)
            eb = sb[0].attn_input
            logits = {}
            for kind in ("oracle",) + KINDS:
                num_blocks = -(-(half + scored) // 16)
                pool, blocks = rt_b.new_kv_pool(num_blocks, 16), list(range(num_blocks))
                for layer in range(n):
                    if kind == "oracle" or layer == 0:
                        k, v = sb[layer].keys, sb[layer].values
                    else:
                        kv = Ridge.apply(maps[(kind, layer)], inputs(sa, eb, layer))
                        k, v = kv[:, : kvh * hd].reshape(-1, kvh, hd), kv[:, kvh * hd:].reshape(-1, kvh, hd)
                    rt_b.write_kv(pool, blocks, layer, k, v)
                logits[kind] = rt_b.extend(pool, [(blocks, half, feed)])[0].double()
            for kind in KINDS:
                tally(totals[kind], logits[kind], logits["oracle"])
    print_totals("fit", totals, num_held, scored)


if __name__ == "__main__":
    a = pair_arguments(__doc__.splitlines()[0]).parse_args()
    main(a.pair, a.num_fit, a.num_held, a.scored)
