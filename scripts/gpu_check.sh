#!/usr/bin/env bash
# GPU acceptance for one machine with an NVIDIA GPU: installs jaxtron with CUDA 12 wheels into
# .venv-gpu (once), then runs the GPU tests, the attention kernel benchmark and the training
# benchmark, writing every result to gpu_check.json (about 4 minutes on one H200).
#   scripts/gpu_check.sh [--out FILE] [--parts tests,kernels,training]
# GPU_PYTHON=python3 scripts/gpu_check.sh uses an interpreter that already has JAX with CUDA
# (a machine with no package index) instead of building the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${GPU_PYTHON:-}" ]; then
  exec "$GPU_PYTHON" -m jaxtron.gpu_check "$@"
fi
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
if [ ! -f "$VENV/.jaxtron-gpu-installed" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e '.[cuda12,test]'
  touch "$VENV/.jaxtron-gpu-installed"
fi
exec "$VENV/bin/python" -m jaxtron.gpu_check "$@"
