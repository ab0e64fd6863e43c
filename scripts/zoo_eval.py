#!/usr/bin/env python3
"""Calibrate every pair of a zoo with the default command, evaluate it on its held-out texts, and
write the zoo's table, worst pair first, with each of issue 40's targets checked.

    python scripts/zoo_eval.py ZOO_DIR [PAIR ...] [--limit N]

Per pair (ZOO_DIR/PAIR: producer/, consumer/, eval/calibration.jsonl, eval/heldout.jsonl, pair.json):
  scd-serve calibrate --producer .. --consumer .. --data eval/calibration.jsonl --kl-budget 0.05 --out codebook
  scd-serve eval --table --data eval/heldout.jsonl --codebook codebook --json eval-table.json
(each skipped when its output is already there: delete it to redo). The table goes to
ZOO_DIR/results.md and to stdout. Held-out texts come from other documents than calibration's
(make-pair-zoo deals documents to splits), so the manifest's figure is checked against texts it
never saw. Plan: a letter per layer (o own, r reuse, P patch, R run), then the prompt's first and
last tokens the consumer computes itself (head, replay).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TARGETS = "KL <= 0.05, top-1 >= 0.95 at <= 0.5 of raw (int8 <= 0.25), rebuild <= 0.5 of the prefill"


def scd_serve(*args: str, log: Path) -> None:
    cmd = [sys.executable, "-m", "scd_serve.cli", *args]
    print("$ scd-serve " + " ".join(args), flush=True)
    started = time.time()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"  rc {rc} in {time.time() - started:.0f} s (log {log})", flush=True)
    if rc:
        raise SystemExit(f"failed: see {log}")


def evaluate(pair: Path, limit: int | None) -> dict:
    book, table = pair / "codebook", pair / "eval-table.json"
    if not (book / "manifest.json").exists():
        scd_serve("calibrate", "--producer", str(pair / "producer"), "--consumer", str(pair / "consumer"),
                  "--data", str(pair / "eval" / "calibration.jsonl"), "--kl-budget", "0.05", "--out", str(book),
                  log=pair / "calibrate.log")
    if not table.exists():
        scd_serve("eval", "--producer", str(pair / "producer"), "--consumer", str(pair / "consumer"),
                  "--data", str(pair / "eval" / "heldout.jsonl"), "--table", "--codebook", str(book),
                  "--json", str(table), *(["--limit", str(limit)] if limit else []), log=pair / "eval.log")
    rows = {r["method"]: r for r in json.loads(table.read_text())["methods"] if "skipped" not in r}
    manifest = json.loads((book / "manifest.json").read_text())
    info = json.loads((pair / "pair.json").read_text())
    plan = " ".join({"own": "o", "reuse": "r", "patch": "P", "run": "R"}[lp["mode"]] for lp in manifest["plans"]["scd"])
    plan += f"; head {manifest.get('head_tokens', 0)}, replay {manifest.get('replay_tokens', 0)}"
    return {"pair": pair.name, "axes": info["axes"], "held_back": info["held_back"], "rows": rows,
            "manifest_kl": manifest["calibration"]["methods"]["scd"]["kl"], "plan": plan}


def checks(e: dict) -> dict[str, bool]:
    r = e["rows"]
    scd, int8, raw, prior = r["scd"], r["scd-int8"], r["raw"], r.get("prior-only", {})
    mism = r.get("mismatched", {})
    out = {"kl": scd["kl"] <= 0.05, "top1": scd["top1"] >= 0.95, "payload": scd["ratio_to_raw16"] <= 0.5,
           "int8": int8["ratio_to_raw16"] <= 0.25 and int8["kl"] <= 0.05,
           "rebuild": scd.get("rebuild_vs_prefill", 1.0) <= 0.5,
           "vs raw": raw["kl"] <= 0.1 or raw["kl"] >= 10 * scd["kl"],
           "codes matter": prior.get("kl", 0) <= 0.05 or scd["kl"] <= 0.5 * prior["kl"],
           "mismatched worse": bool(mism) and mism["kl"] > scd["kl"],
           "manifest": abs(e["manifest_kl"] - scd["kl"]) <= 0.25 * scd["kl"]}
    return out


def table(evals: list[dict]) -> str:
    lines = [f"Targets: {TARGETS}. KL and top-1 on each pair's held-out texts (other documents).", "",
             "| pair | what the fine-tune changed | raw KL | prior-only KL | mismatched KL | scd KL | scd top-1 | "
             "scd vs raw | rebuild | scd-int8 KL / vs raw | manifest KL (vs held-out) | plan | targets missed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in sorted(evals, key=lambda e: -e["rows"]["scd"]["kl"]):
        r = e["rows"]
        g = lambda m, k, f=".3f": format(r[m][k], f) if m in r and r[m].get(k) is not None else "-"
        missed = [k for k, ok in checks(e).items() if not ok]
        ratio = e["manifest_kl"] / r["scd"]["kl"] if r["scd"]["kl"] else float("nan")
        name = e["pair"] + (" (held-back seed)" if e["held_back"] else "")
        lines.append(f"| {name} | {e['axes']} | {g('raw', 'kl')} | {g('prior-only', 'kl')} | {g('mismatched', 'kl')} | "
                     f"{g('scd', 'kl', '.4f')} | {g('scd', 'top1')} | {g('scd', 'ratio_to_raw16')} | "
                     f"{g('scd', 'rebuild_vs_prefill', '.2f')} | {g('scd-int8', 'kl', '.4f')} / "
                     f"{g('scd-int8', 'ratio_to_raw16')} | {e['manifest_kl']:.4f} ({ratio:.2f}x) | {e['plan']} | "
                     f"{', '.join(missed) or 'none'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("zoo", help="make-pair-zoo's --out directory")
    p.add_argument("pairs", nargs="*", help="pairs to run (default: every finished pair)")
    p.add_argument("--limit", type=int, default=None, help="held-out records evaluated per pair (default all)")
    args = p.parse_args()
    zoo = Path(args.zoo)
    names = args.pairs or sorted(d.name for d in zoo.iterdir() if (d / "pair.json").exists())
    if not names:
        raise SystemExit(f"{zoo}: no finished pairs (pair.json); run scd-serve make-pair-zoo --out {zoo} first")
    evals = [evaluate(zoo / n, args.limit) for n in names]
    text = table(evals)
    (zoo / "results.md").write_text("# Zoo results\n\n" + text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
