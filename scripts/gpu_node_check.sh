#!/usr/bin/env bash
# Check Genie on a GPU node: the CUDA data-path tests (a real genie-daemon on cuda:0), random
# view / in-place / autograd programs against this process's own GPU, the demo with its embedded
# daemon on the GPU, the GPU data-path benchmark, and the OpInfo sweep in three layouts (and
# complex64 as conjugate views) against a daemon on the GPU, compared with this process's own GPU
# (gradients with the CPU's: a local CUDA backward is impossible after import genie); do CUDA
# kernels hold any result otherwise than the meta kernels plan it? (daemon/layouts.py lists the ops
# where the CPU's do). Nodes whose image holds torch but not Genie: scripts/gpu_quick_check.sh. Needs CUDA torch,
# Genie and its test extras installed (pip install -e ".[test]"); GPU memory over UCX is checked
# where ucxx is installed (pip install ucxx-cu12), else that test says it is skipped. Exit status:
# 0 when all pass.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible to torch')" || exit 1
status=0
timeout 600 python3 -m pytest -q -p no:cacheprovider --timeout 120 -rfE tests/test_cuda_paths.py tests/test_cuda_ucx.py || status=1
# Random view / in-place / autograd programs against the CPU (the session daemon takes cuda:0: --device auto).
timeout 600 python3 -m pytest -q -p no:cacheprovider --timeout 300 -rfE -W ignore tests/test_random_programs.py || status=1
timeout 300 python3 -m genie.examples.demo || status=1
timeout 600 python3 -m bench.gpu_paths --repeats 5 || status=1
for layout in as_given channels_last permuted; do
  timeout 1200 python3 -m bench.opinfo_sweep --layout "$layout" --strict-layouts --reference cuda | tail -4 || status=1
done
timeout 1200 python3 -m bench.opinfo_sweep --dtype complex64 --layout conj_view --strict-layouts --reference cuda | tail -4 || status=1
timeout 1200 python3 -m bench.opinfo_sweep --backward | tail -4 || status=1
# Gradients with channels-last inputs (attention takes torch's math backend there) and forward-mode AD.
timeout 1200 python3 -m bench.opinfo_sweep --backward --layout channels_last | tail -4 || status=1
timeout 1200 python3 -m bench.opinfo_sweep --forward-ad --reference cuda | tail -4 || status=1
exit $status
