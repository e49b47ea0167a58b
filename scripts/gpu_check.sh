#!/usr/bin/env bash
# GPU acceptance for one machine with an NVIDIA GPU: installs jaxtron with CUDA 12 wheels into
# .venv-gpu (once), then runs the GPU tests, the attention kernel benchmark and the training
# benchmark, writing every result to gpu_check.json (about 7 minutes on one GPU).
#   scripts/gpu_check.sh [--out FILE] [--parts tests,kernels,training]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
if [ ! -f "$VENV/.jaxtron-gpu-installed" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e '.[cuda12,test]'
  touch "$VENV/.jaxtron-gpu-installed"
fi
exec "$VENV/bin/python" -m jaxtron.gpu_check "$@"
