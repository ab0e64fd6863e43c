"""`scd-serve demo`, run as a user runs it: a real cluster of the context pair (gateway, prefill,
decode processes) behind a shaped link, two held-out prompts through every method. The table
must be printed, every row's label must match what its transfer moved, scd must answer right
where raw (the producer's K/V unchanged) does not, and the PNG must be written. Once with the
kernel's shaping where this machine allows it (root: a network namespace), once with the
userspace proxy, which must say on screen that it emulates the rate."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
METHODS = ["local", "raw", "scd", "scd-int8", "auto"]


@pytest.mark.parametrize("link", ["default", "proxy"])
def test_demo_prints_the_table_and_the_labels_match_the_wire(tmp_path, link):
    argv = [sys.executable, "-m", "scd_serve.cli", "demo", "--prompts", "2", "--out", str(tmp_path), "--rate", "50mbit"]
    res = subprocess.run(argv + (["--no-netns"] if link == "proxy" else []), cwd=ROOT, capture_output=True,
                         text=True, timeout=840, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    for m in METHODS:
        assert any(line.startswith(m + " ") for line in out.splitlines()), (m, out)
    assert "expected" in out and "wall time" in out and "auto picked" in out
    if link == "proxy":
        assert "EMULATED" in out

    doc = json.loads((tmp_path / "demo.json").read_text())
    rows, summary = doc["rows"], doc["summary"]
    assert len(rows) == 2 * len(METHODS) and [p["answer"] for p in doc["prompts"]]
    for r in rows:
        assert r["header"] == r["served"], r  # header and body agree
        if r["method"] != "auto":
            assert r["served"] == r["method"], r  # a forced method is what served (no fallback here)
        if r["served"] == "local":
            assert r["wire_bytes"] == 0 and r["raw_kv_bytes"] is None, r
        else:
            assert r["wire_bytes"] > 0 and r["raw_kv_bytes"] > 0, r
    share = {m: summary[m]["wire_share"] for m in ("raw", "scd", "scd-int8")}
    assert share["raw"] == pytest.approx(1.0, abs=0.01) and share["scd-int8"] < share["scd"] < 0.5, share
    assert summary["local"]["right"] == 2  # the oracle
    assert summary["scd"]["right"] > summary["raw"]["right"], summary  # what SCD buys on this pair
    assert set(summary["auto"]["served"]) <= set(METHODS) - {"auto"}
    png = tmp_path / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in out
