#!/usr/bin/env bash
# last H100 call: the core GPU grid (fwd, bwd, tuning: every point of each family's space) and the sanitizers at HEAD
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L
START=$(date +%s); BUDGET=${BUDGET:-570}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
step precompile 120 python3 tests/gpu_precompile.py --processes 16
step pytest_core 250 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py tests/test_tuning_gpu.py
step memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu_sanitize.py
for fam in fa2_fwd fa2_bwd sm90_fwd decode_splitkv; do
  step "racecheck_$fam" 40 compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu_sanitize.py --quick --families "$fam"
done
step synccheck_fwd 40 compute-sanitizer --tool synccheck --error-exitcode 1 python3 tests/gpu_sanitize.py --families sm90_fwd
cd $OUT && gzip -f logs/pytest_core.log; tar czf logs.tgz logs
