"""PNG figures of `bench ttft`: TTFT against bandwidth per method, and F1-vs-TTFT per bandwidth."""

from __future__ import annotations

import math
from pathlib import Path

from scd_serve.extras import pyplot


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rows(doc: dict, tokens: int, mode: str):
    for p in doc["sweep"]:
        for r in p["rows"]:
            if r["prompt_tokens"] == tokens and r["mode"] in (mode, "local") and r["ttft_s"] is not None:
                yield p, r


def ttft_vs_bandwidth(doc: dict, path: Path, tokens: int, mode: str = "warm") -> Path:
    plt = pyplot("bench", "bench --plot")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[float, float]]] = {}
    for p, r in _rows(doc, tokens, mode):
        series.setdefault(r["method"], []).append((p["bandwidth_bytes_per_s"] * 8 / 1e9, r["ttft_s"] * 1e3))
    for method, pts in sorted(series.items()):
        pts.sort()
        style = "k--" if method == "oracle" else "o-"
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=method, markersize=4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth (Gbit/s)")
    ax.set_ylabel(f"median TTFT, {mode} (ms)")
    ax.set_title(f"TTFT vs bandwidth, {tokens}-token prompts ({doc['link']['kind']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def pareto(doc: dict, f1: dict[str, float], path: Path, tokens: int, mode: str = "warm") -> Path:
    plt = pyplot("bench", "bench --plot")
    n = len(doc["sweep"])
    cols = min(3, max(1, n))
    rows = math.ceil(n / cols) if n else 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, p in zip(axes.flat, doc["sweep"]):
        for r in p["rows"]:
            if r["prompt_tokens"] != tokens or r["mode"] not in (mode, "local") or r["method"] not in f1:
                continue
            x, y = r["ttft_s"] * 1e3, f1[r["method"]]
            ax.scatter([x], [y], s=25, marker="*" if r["method"].startswith("scd") else "o")
            ax.annotate(r["method"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_title(f"{p['bandwidth']}", fontsize=9)
        ax.set_xlabel("median TTFT (ms)", fontsize=8)
        ax.set_ylabel("F1", fontsize=8)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"quality vs TTFT per bandwidth ({tokens} tokens, {mode}); up-left is better", fontsize=10)
    return _save(plt, fig, path)
