#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L
START=$(date +%s); BUDGET=${BUDGET:-470}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
PT="python3 -m pytest -m gpu -q -p no:cacheprovider"
CUDA_LAUNCH_BLOCKING=1 step dqbulk 150 $PT -x tests/test_sm90_bwd_dqbulk_gpu.py
step timing 60 python3 tests/sm90_bwd_dqbulk_timing.py --hdims 64 128
step dropmix 120 $PT tests/test_dropmix_gpu.py
step grid_dqb 100 python3 grid_dqbulk.py
step ring1 60 $PT tests/test_distributed_gpu.py
step memcheck_dqb 60 compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sm90_bwd_dqbulk_gpu.py -k "1023 or 17" -x
step synccheck_dqb 60 compute-sanitizer --tool synccheck --error-exitcode 1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sm90_bwd_dqbulk_gpu.py -k "1023 or 17" -x
cd $OUT && tar czf logs.tgz logs
