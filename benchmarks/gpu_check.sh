#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): run from the repository root on a machine with a
# GPU and a CUDA build of torch, in one call of at most 8 minutes. Exit 2: no CUDA here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  PY=.venv/bin/python
fi
nvidia-smi --query-gpu=name,memory.total --format=csv || true
exec timeout 480 "$PY" benchmarks/gpu_check.py "$@"
