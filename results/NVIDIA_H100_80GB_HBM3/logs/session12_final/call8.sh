#!/usr/bin/env bash
# final H100 call: features benchmark (dq_writer backward under the features), sanitizers of the featured kernels
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L
START=$(date +%s); BUDGET=${BUDGET:-560}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
G=results/NVIDIA_H100_80GB_HBM3
step features_bench 230 python3 -m cuflash bench --mode features
step race_features 160 compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu_sanitize.py --quick --features
step sync_features 140 compute-sanitizer --tool synccheck --error-exitcode 1 python3 tests/gpu_sanitize.py --quick --features
mkdir -p $OUT/res && cp $G/features.* $OUT/res/ 2>/dev/null
cd $OUT && tar czf logs.tgz logs res
