"""The demo's output: per method a summary of its requests, one text table, one PNG.

Plain Python apart from the figure (matplotlib, the bench extra: without it the table says
how to get the PNG). Every number comes from a response: TTFT as the client saw it, bytes and
rebuild time from the response's `scd.transfer`, the method from `scd.method`.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from scd_serve.bench.stats import median
from scd_serve.errors import ConfigError
from scd_serve.planner.units import fmt_bytes

ORACLE = "local"  # the consumer's own prefill of the prompt: what every transfer is judged against


def summarize(rows: list[dict], methods: list[str], num_prompts: int) -> dict[str, dict]:
    out = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        moved = [r for r in mine if r["raw_kv_bytes"]]
        rebuilt = [r["rebuild_ms"] for r in moved if r["rebuild_ms"] is not None]
        out[m] = {"right": sum(r["right"] for r in mine), "of": num_prompts,
                  "ttft_ms": median([r["ttft_s"] * 1e3 for r in mine]) if mine else None,
                  "wire_bytes": median([r["wire_bytes"] for r in mine]) if mine else 0,
                  "wire_share": median([r["wire_bytes"] / r["raw_kv_bytes"] for r in moved]) if moved else None,
                  "rebuild_ms": median(rebuilt) if rebuilt else None,
                  "served": dict(Counter(r["served"] for r in mine)),
                  "reasons": dict(Counter(f"{r['reason']}" + (f": {r['detail']}" if r["detail"] else "")
                                          for r in mine)),
                  "cache_hits": sum(r["cache_hit"] for r in mine)}
    return out


def _mark(ok: bool) -> str:
    marks = ("\u2713", "\u2717")  # check and cross, or plain letters where the terminal cannot show them
    try:
        "".join(marks).encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        marks = ("+", "x")
    return marks[0] if ok else marks[1]


def _answer(text: str, ok: bool) -> str:
    shown = " ".join(text.split())[:5] or "''"
    return f"{shown}{_mark(ok)}"


def _served(m: str, s: dict) -> str:
    if m == ORACLE:
        return "local (oracle)"
    return ", ".join(f"{k} x{v}" if len(s["served"]) > 1 or m == "auto" else str(k)
                     for k, v in sorted(s["served"].items(), key=lambda kv: -kv[1]))


def render(doc: dict, png: Path | None) -> str:
    prompts, summary = doc["prompts"], doc["summary"]
    lengths = [p["prompt_tokens"] for p in prompts]
    head = (f"scd-serve demo: {doc['pair']}, {len(prompts)} held-out prompts of {min(lengths):,}-{max(lengths):,} "
            f"tokens, one request per method and prompt\n"
            f"link: {doc['rate']}, {doc['shaping']}\n")
    cols = [f"{i + 1:<7}" for i in range(len(prompts))]
    lines = [f"{'method':<10} {'served as':<18} {'right':>5} {'TTFT p50':>9} {'on the wire':>19} {'rebuild':>8}   "
             + "".join(cols),
             f"{'expected':<10} {'':<18} {'':>5} {'':>9} {'':>19} {'':>8}   "
             + "".join(f"{p['answer']:<7}" for p in prompts)]
    for m, s in summary.items():
        answers = {r["prompt"]: _answer(r["text"], r["right"]) for r in doc["rows"] if r["method"] == m}
        wire = fmt_bytes(s["wire_bytes"]) + (f" ({s['wire_share']:.2f} raw)" if s["wire_share"] is not None else "")
        rebuild = f"{s['rebuild_ms']:.0f} ms" if s["rebuild_ms"] is not None else "-"
        ttft = f"{s['ttft_ms']:.0f} ms" if s["ttft_ms"] is not None else "-"
        lines.append(f"{m:<10} {_served(m, s):<18} {s['right']:>2}/{s['of']:<2} {ttft:>9} {wire:>19} {rebuild:>8}   "
                     + "".join(f"{answers.get(i, '-'):<7}" for i in range(len(prompts))))
    notes = [f"oracle = `{ORACLE}`: the consumer prefills the prompt itself; right = the answer equals the expected "
             f"one; TTFT = the client's, through the gateway; bytes and rebuild from each response's `scd` field"]
    for m in ("auto",):
        if m in summary:
            why = "; ".join(f"{k} x{v}" for k, v in summary[m]["reasons"].items())
            notes.append(f"auto picked {_served(m, summary[m])} ({why})")
    if hits := {m: s["cache_hits"] for m, s in summary.items() if s["cache_hits"]}:
        notes.append("codes served from the prefill worker's cache (no producer prefill): "
                     + ", ".join(f"{m} {n}/{summary[m]['of']}" for m, n in hits.items()))
    notes.append(f"wall time {doc['wall_s']:.0f} s (cluster start {doc['start_s']:.0f} s); "
                 + (f"figure {png}; " if png else "no figure: pip install 'scd-serve[bench]' for the PNG; ")
                 + "other links: scd-serve demo --rate 10mbit (or 1gbit)")
    return head + "\n" + "\n".join(line.rstrip() for line in lines) + "\n\n" + "\n".join(notes)


def write_png(doc: dict, path: Path) -> Path | None:
    """TTFT (median and each request) and answers right per method; None without matplotlib."""
    from scd_serve.extras import pyplot

    try:
        plt = pyplot("bench", "the demo's figure")
    except ConfigError:
        return None
    summary = doc["summary"]
    methods = list(summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    xs = range(len(methods))
    ax1.bar(xs, [summary[m]["ttft_ms"] or 0 for m in methods], color="#8fb3d9", label="median")
    for x, m in zip(xs, methods):
        pts = [r["ttft_s"] * 1e3 for r in doc["rows"] if r["method"] == m]
        ax1.plot([x] * len(pts), pts, "k.", markersize=4)
    ax1.set_ylabel("time to first token (ms)")
    ax2.bar(xs, [summary[m]["right"] / max(1, summary[m]["of"]) for m in methods], color="#9bd08f")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("answers right (share)")
    for ax in (ax1, ax2):
        ax.set_xticks(list(xs), methods)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"scd-serve demo: {doc['pair']}, {len(doc['prompts'])} prompts, link {doc['rate']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
