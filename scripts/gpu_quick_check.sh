#!/usr/bin/env bash
# A short check of a GPU node, run from this source tree without installing Genie (an image that
# holds CUDA torch but not Genie; wheels of packages it lacks, e.g. pyzmq and pytest-asyncio, in
# .whl/): a daemon on the GPU with its stderr kept (scripts/gpu_daemon_diag.py), the CUDA tests,
# the op tests, OpInfo samples of ops where layouts matter, the transfer bench (unless SKIP_BENCH),
# then the rest of the suite in SHARDS parallel shards (default 8) until BUDGET seconds (default 520);
# with FILES set, only the device-assert check and those test files. Logs: $OUT/logs.tgz (default
# OUT: /tmp/genie-gpu-check).
# scripts/gpu_node_check.sh is the long, installed form.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/genie-gpu-check}; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1
T0=$(date +%s); DEADLINE=$((T0 + ${BUDGET:-520}))
left() { echo $(( DEADLINE - $(date +%s) )); }
step() {  # step NAME SECONDS CMD...: bounded by its own limit and the lease's deadline
  local name=$1 lim=$2; shift 2; local l; l=$(left); [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -le 5 ]; then echo "### $name: skipped, no time left"; return; fi
  echo "### $name (limit ${lim}s) at $(( $(date +%s) - T0 ))s"
  local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "### $name rc=$rc in $(( $(date +%s) - s ))s"; tail -n ${TAILN:-15} "$OUT/$name.log"
}
if ls .whl/*.whl >/dev/null 2>&1; then
  # pytest-asyncio 1.5 needs pytest >= 8.4: carry ours only where the image's is older.
  W=$(ls .whl/*.whl | grep -v -E "/(pytest|pluggy)-")
  python3 -c "import pytest, sys; sys.exit(tuple(map(int, pytest.__version__.split('.')[:2])) < (8, 4))" || W="$W $(ls .whl/pytest-*.whl .whl/pluggy-*.whl)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W || exit 3
fi
mkdir -p /tmp/gl && ln -sfn "$PWD/daemon" /tmp/gl/genie_daemon
export PYTHONPATH=/tmp/site:$PWD:/tmp/gl
nvidia-smi -L; nproc; which g++
python3 -c "import torch, zmq, pytest, pytest_asyncio, genie_daemon; print(torch.__version__, torch.cuda.is_available(), zmq.__version__, pytest.__version__, pytest_asyncio.__version__)"
export PYTHONFAULTHANDLER=1  # a crash prints every thread's Python stack (daemons too)
TAILN=8 step device_assert 60 python3 scripts/gpu_device_assert.py
if [ -z "${FILES:-}" ]; then  # FILES="tests/a.py tests/b.py": only those, in shards, after the assert check
  step opinfo_import 45 python3 -c "import genie, torch; import torch.testing._internal.common_methods_invocations as m; print('OpInfos', len(m.op_db))"
  TAILN=20 step diag 60 python3 scripts/gpu_daemon_diag.py
  step cuda_paths 60 python3 -m pytest -q --timeout 40 -rfE tests/test_cuda_paths.py
  step streams 40 python3 -m pytest -q --timeout 30 -rfE tests/test_streams_events.py
  step moves 60 python3 -m pytest -q --timeout 40 -rfE tests/test_cuda_moves.py
  step demo 60 python3 -m genie.examples.demo
  step ops 90 python3 -m pytest -q --timeout 30 -rfE tests/test_ops.py
  OPS=nn.functional.conv2d,nn.functional.conv_transpose2d,nn.functional.batch_norm,nn.functional.layer_norm,nn.functional.max_pool2d,nn.functional.avg_pool2d,nn.functional.interpolate,matmul,addmm,bmm,nn.functional.scaled_dot_product_attention,nn.functional.linear,softmax,sum,nn.functional.group_norm,nn.functional.embedding,cumsum,sort,index_put,nn.functional.cross_entropy
  step sweep 60 python3 -m bench.opinfo_sweep --strict-layouts --reference cuda --ops "$OPS"
  step sweep_backward 60 python3 -m bench.opinfo_sweep --backward --ops "$OPS"
  [ -z "${SKIP_BENCH:-}" ] && step gpu_paths 100 python3 -m bench.gpu_paths --repeats 3
fi
# Whatever time is left: the rest of the suite in parallel shards (scripts/gpu_test_shards.sh).
if [ -n "${FILES:-}" ]; then
  TAILN=200 step suite $(( $(left) - 15 )) bash scripts/gpu_test_shards.sh ${SHARDS:-8} $(( $(left) - 25 )) --only $FILES
else
  TAILN=200 step suite $(( $(left) - 15 )) bash scripts/gpu_test_shards.sh ${SHARDS:-8} $(( $(left) - 25 )) \
    tests/test_cuda_paths.py tests/test_streams_events.py tests/test_cuda_moves.py tests/test_ops.py
fi
echo "### end at $(( $(date +%s) - T0 ))s"
# The device tool brings back a few files only: every log, in one archive.
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz -- * && find . -type f ! -name logs.tgz -delete)
