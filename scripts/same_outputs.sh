#!/bin/bash
# Did a change keep behaviour? Greedy completions of every served method through a real
# `scd-serve up` cluster, and `eval --table` on the embedded pair, at one commit, hashed.
# Run it at two commits and compare the hashes (timings are dropped from the eval JSON).
#   bash scripts/same_outputs.sh COMMIT [PORT] [OUT_DIR]
set -eu
C=$1; PORT=${2:-18411}; OUT=${3:-out/same-outputs}
ROOT=$(git rev-parse --show-toplevel); PY=$ROOT/.venv/bin/python
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); WT=$OUT/wt-$C
[ -d "$WT" ] || git -C "$ROOT" worktree add -f "$WT" "$C" >/dev/null
cd "$WT"
PYTHONPATH=$WT $PY -m scd_serve.cli eval --table --producer models/demo-pair/producer \
  --consumer models/demo-pair/consumer --codebook models/demo-pair/codebook --limit 40 --text-limit 10 \
  --json "$OUT/$C.eval-full.json" > "$OUT/$C.eval.log" 2>&1
PYTHONPATH=$WT setsid $PY -m scd_serve.cli up --port "$PORT" > "$OUT/$C.up.log" 2>&1 &
UP=$!
trap 'kill -- -$UP 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
$PY - "$PORT" "$OUT/$C" <<'PY'
import json, sys, urllib.request
port, out = sys.argv[1], sys.argv[2]
base = f"http://localhost:{port}/v1"
model = json.load(urllib.request.urlopen(f"{base}/models", timeout=30))["data"][0]["id"]
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Question: what is 2+2? Answer:",
           "In the beginning " * 20]
greedy = {}
for m in ("local", "raw", "identity", "quant4", "droidspeak", "reuse", "scd", "scd-int8"):
    for i, p in enumerate(prompts):
        body = json.dumps({"model": model, "prompt": p, "max_tokens": 24, "temperature": 0, "scd_method": m}).encode()
        req = urllib.request.Request(f"{base}/completions", body, {"content-type": "application/json"})
        greedy[f"{m}/{i}"] = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["text"]
json.dump(greedy, open(f"{out}.greedy.json", "w"), indent=1, sort_keys=True)
timed = ("seconds", "rebuild_vs_prefill", "table")  # wall-clock figures, and the printed table that shows them
rows = json.load(open(f"{out}.eval-full.json"))
strip = lambda x: ({k: strip(v) for k, v in x.items() if k not in timed} if isinstance(x, dict)
                   else [strip(v) for v in x] if isinstance(x, list) else x)
json.dump(strip(rows), open(f"{out}.eval.json", "w"), indent=1, sort_keys=True)
PY
sha256sum "$OUT/$C.greedy.json" "$OUT/$C.eval.json"
