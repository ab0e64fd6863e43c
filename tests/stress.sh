#!/usr/bin/env bash
# `make test-stress`: the whole suite under ATEN_CPU_CAPABILITY=default, then =avx2, then with a
# busy-loop process holding one core. Prints one line per run (counts and seconds); exits non-zero
# if any run failed. Logs: out/stress/<run>.log
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p out/stress
status=0
run() {  # run NAME [env assignments...]
    local name=$1; shift
    local t0=$SECONDS
    env "$@" "$PY" -m pytest -q -p no:cacheprovider tests > "out/stress/$name.log" 2>&1
    local rc=$?
    echo "stress $name: rc=$rc in $((SECONDS - t0)) s: $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "out/stress/$name.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
}
run cpu-default ATEN_CPU_CAPABILITY=default
run cpu-avx2 ATEN_CPU_CAPABILITY=avx2
"$PY" -c "while True: pass" &
busy=$!
trap 'kill $busy 2>/dev/null' EXIT
run busy-core SCD_STRESS_BUSY=1
kill $busy 2>/dev/null
exit $status
