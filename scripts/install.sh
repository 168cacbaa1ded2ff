#!/usr/bin/env bash
# Installs Genie and its test tools into the current Python. The CPU build of torch is
# pinned here (a bare `torch` requirement can pull a multi-GB CUDA build); on a GPU
# node install your CUDA torch first and this keeps it (any torch>=2.13 satisfies it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]) >= (2, 13) else 1)" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
# The UCX lane's library (optional for users; here so its tests run). Where no wheel exists for
# this platform the suite still runs: those tests then skip, saying why.
"$PY" -m pip install -q "ucxx-cu12>=0.52" || echo "install.sh: ucxx-cu12 not installed; the UCX lane's tests will skip"
