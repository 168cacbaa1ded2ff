#!/usr/bin/env bash
# The rest of the test suite on a GPU node, in parallel shards (a node has cores to spare and a lease
# of minutes): usage `gpu_test_shards.sh SHARDS SECONDS [FILE_TO_SKIP...]` (or `... --only FILE...`). Each shard is one pytest
# process over every SHARDS-th test file (largest first, so shards end together), bounded by SECONDS;
# (then interrupted, so that pytest still prints what failed); logs in $OUT/shard_N.log, and each shard's closing line and failures printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
SHARDS=$1; LIMIT=$2; shift 2
OUT=${OUT:-/tmp/genie-gpu-check}; mkdir -p "$OUT"
files=()
if [ "${1:-}" = "--only" ]; then
  shift; files=("$@")
else
  skip=" $* "
  for f in $(ls -S tests/test_*.py) tests/unit; do
    case "$skip" in *" $f "*) continue;; esac
    files+=("$f")
  done
fi
pids=()
for ((s = 0; s < SHARDS; s++)); do
  mine=()
  for ((i = s; i < ${#files[@]}; i += SHARDS)); do mine+=("${files[$i]}"); done
  [ ${#mine[@]} -eq 0 ] && continue
  echo "shard $s: ${mine[*]}" > "$OUT/shard_$s.log"
  timeout -s INT -k 10 "$LIMIT" python3 -m pytest -q --timeout 60 -rfE -W ignore "${mine[@]}" \
    >> "$OUT/shard_$s.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for ((s = 0; s < SHARDS; s++)); do
  [ -f "$OUT/shard_$s.log" ] || continue
  echo "--- shard $s"; grep -E "^(FAILED|ERROR) |passed|failed|error" "$OUT/shard_$s.log" | tail -n 25 | cut -c1-300
done
