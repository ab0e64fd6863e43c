"""Decoder-side information (issue 40, a measurement, not built): if the consumer ran its own first
k layers (k/N of a prefill), its attention input at layer k would be exact on the decode side. How
much of its upper layers' K/V would that explain, beside the producer's attention input of the
layer (what the codes are fitted on now)? Per layer j > k and stream, the relative squared error
left of what the consumer's token prior leaves, linear maps at full width fitted on the first 80%
of the pair's calibration documents and scored on the rest (as scripts/code_fit_study.py):

    .venv/bin/python scripts/side_info_study.py PAIR_DIR [--side 1 2]
"""

from __future__ import annotations

import argparse

import torch
from code_fit_study import pair_rows, scored_error


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pair")
    p.add_argument("--side", type=int, nargs="+", default=[1, 2], help="layers k whose exact input the consumer has")
    args = p.parse_args()
    torch.set_num_threads(1)
    d = pair_rows(args.pair)
    rows, scored = d.rows, d.scored
    ks = ", ".join(f"k={k}" for k in args.side)
    print(f"stream layer: producer's input of the layer / the consumer's own at {ks} alone / both, at {ks}")
    for s in ("k", "v"):
        for j in range(min(args.side) + 1, len(rows)):
            b, bv = d.left("fit", j, s), d.left("score", j, s)
            own, own_v = rows[j]["h"][0], scored[j]["h"][0]  # [N, hidden]: the producer's attention input
            alone, both = [], []
            for k in args.side:
                if k >= j:
                    alone.append("-")
                    both.append("-")
                    continue
                side, side_v = rows[k]["h"][1], scored[k]["h"][1]  # the consumer's own attention input at k
                alone.append(f"{scored_error(side, b, side_v, bv, b.shape[1]):.3f}")
                joint = scored_error(torch.cat([own, side], 1), b, torch.cat([own_v, side_v], 1), bv, b.shape[1])
                both.append(f"{joint:.3f}")
            print(f"{s} {j}: {scored_error(own, b, own_v, bv, b.shape[1]):.3f} / {' '.join(alone)} / {' '.join(both)}",
                  flush=True)


if __name__ == "__main__":
    main()
