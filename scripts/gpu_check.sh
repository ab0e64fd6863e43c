#!/usr/bin/env bash
# Issue 21's GPU figures in one command, for a session lent a GPU (estimated at about 7 minutes on an H200; not yet run on one):
#   here:  bash scripts/gpu_wheels.sh
#   there: bash scripts/gpu_check.sh        (device run: carry [".whl"], timeout_s 600)
# Stages, each under its own deadline, each writing to $OUT (out/gpu when unset) as it ends:
#   1. the CUDA tests (parity of the runtime, the Triton kernel compiled against the torch path)
#   2. the Qwen2.5-0.5B-shaped random pair (make-shaped-pair)
#   3. decode step time at 16 streams, 256 and 2,048 tokens of context, kernel vs torch path
#   4. bench serve --mixed: the engine against static batches and sequential generate
# DEVICE=cpu SMALL=1 runs the same stages on a small setting here (to try the script).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then  # the serving stack the device image lacks
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stage() {  # stage NAME SECONDS CMD...: its output to $OUT/NAME.log, one status line here
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s"
    tail -n 25 "$OUT/$name.log"
    return $rc
}

{ nvidia-smi -L 2>/dev/null; $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda',
torch.cuda.is_available(), 'transformers', transformers.__version__)"; $PY -c "import triton; print('triton', triton.__version__)"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

stage tests 150 $PY -m pytest -q -p no:cacheprovider -o addopts= tests/unit/model/test_model_paged_kernel.py \
    tests/unit/model/test_model_batching.py tests/unit/model/test_model_parity.py -rs

PAIR=/tmp/shaped
if [ -n "${SMALL:-}" ]; then
    CONFIG=(--config qwen2.5-0.5b --layers 2 --records 40)
    CONTEXTS=(64 256); STEPS=3; MIXED=(--quick --mixed)
else
    CONFIG=(--config qwen2.5-0.5b)
    CONTEXTS=(256 2048); STEPS=20; MIXED=(--mixed)
fi
stage pair 240 $PY -m scd_serve.cli make-shaped-pair "${CONFIG[@]}" --out "$PAIR" || exit 1

for attention in auto torch; do
    stage "decode-step-$attention" 120 $PY -m scd_serve.bench.decode_step --model "$PAIR/consumer" --device "$DEVICE" \
        --dtype "$DTYPE" --batch 16 --context "${CONTEXTS[@]}" --steps "$STEPS" --attention "$attention"
done

stage serve-mixed 420 $PY -m scd_serve.cli bench serve "${MIXED[@]}" --consumer "$PAIR/consumer" --device "$DEVICE" \
    --dtype "$DTYPE" --json "$OUT/serve-mixed.json" --start-timeout 180 --request-timeout 400
