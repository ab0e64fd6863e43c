"""F1 per transfer method from the eval harness's JSON (`scd-serve eval --table --json`)."""

from __future__ import annotations

import json
from pathlib import Path

from scd_serve.errors import ConfigError


def f1_by_method(path: Path) -> dict[str, float]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read quality JSON {path}: {exc}", field="quality") from exc
    rows = doc.get("methods") or doc.get("rows") or doc.get("results") or doc
    out: dict[str, float] = {}
    if isinstance(rows, dict):
        rows = [dict(v, method=k) if isinstance(v, dict) else {"method": k, "f1": v} for k, v in rows.items()]
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and "method" in row and isinstance(row.get("f1"), (int, float)):
            out[str(row["method"])] = float(row["f1"])
    if not out:
        raise ConfigError(f"no per-method F1 found in {path}", field="quality")
    if "local" in out and "oracle" not in out:
        out["oracle"] = out["local"]
    return out
