"""The rank/patch trade-off figure written next to a codebook (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

from scd_serve.codec.plan import REUSE, Plan
from scd_serve.calibration.search import SearchPoint
from scd_serve.extras import pyplot


def plot_tradeoff(curve: list[SearchPoint], chosen: Plan, raw_width: int, budget: float, path: Path) -> Path:
    """Left: payload (fraction of raw 16-bit KV) and measured KL per patch count at the budget.
    Right: the chosen plan's ranks per layer."""
    plt = pyplot("calibrate", "calibrate's trade-off figure")

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ks = [p.num_patches for p in curve]
    ratio = [p.plan.code_width() / raw_width for p in curve]
    ax.plot(ks, ratio, "o-", color="tab:blue", label="payload / raw (at budget)")
    for p, r in zip(curve, ratio):
        if not p.feasible:
            ax.plot([p.num_patches], [r], "x", color="tab:red", markersize=10)
    ax.set_xticks(ks)
    ax.set_xlabel("patch layers")
    ax.set_ylabel("payload / raw 16-bit KV", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(ks, [p.kl for p in curve], "s--", color="tab:orange", label="KL at budget plan")
    ax2.plot(ks, [p.kl_full_rank for p in curve], "^:", color="tab:green", label="KL at full rank")
    ax2.axhline(budget, color="gray", lw=0.8)
    ax2.set_ylabel("KL vs oracle (nats/token)")
    ax.set_title("rank / patch trade-off (x: over budget)")
    ax2.legend(loc="upper right", fontsize=8)
    layers = range(len(chosen.layers))
    rk = [lp.r_k for lp in chosen.layers]
    rv = [lp.r_v for lp in chosen.layers]
    rh = [lp.r_h if lp.mode != REUSE else 0 for lp in chosen.layers]
    bx.bar([i - 0.25 for i in layers], rk, width=0.25, label="r_k (reuse)")
    bx.bar(list(layers), rv, width=0.25, label="r_v (reuse)")
    bx.bar([i + 0.25 for i in layers], rh, width=0.25, label="r_h (patch; run: the residual)")
    bx.set_xlabel("layer")
    bx.set_ylabel("code rank")
    bx.set_title("chosen plan")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
