#!/usr/bin/env bash
# Wheels the device machine's image lacks for serving (its Python 3.12 has torch, Triton,
# transformers, numpy, httpx, anyio, prometheus-client, xxhash; not the web stack, pyzmq, or
# the grpcio/protobuf our committed stubs need), at constraints.txt's versions, into .whl/
# (ignored by git, carried by the device call). Run here, then scripts/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
names="fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions
       pyzmq grpcio grpcio-health-checking protobuf"
pins=()
for n in $names; do
    pin=$(grep -i "^$n==" constraints.txt) || { echo "no pin for $n in constraints.txt" >&2; exit 1; }
    pins+=("$pin")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"
du -sh .whl
