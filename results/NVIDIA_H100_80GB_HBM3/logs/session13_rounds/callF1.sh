#!/usr/bin/env bash
# final round F1 at merged HEAD: core grid, every new family variant's GPU tests, sanitizers
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
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv > $L/gpu.txt 2>&1
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20"
step precompile 100 python3 tests/gpu_precompile.py --processes 16
( python3 tests/dropout_precompile.py > $L/pre_drop.log 2>&1; python3 tests/test_sm90_bwd_d64_gpu.py --precompile > $L/pre_d64.log 2>&1; python3 tests/test_bwd_pre_gpu.py --precompile > $L/pre_bwdpre.log 2>&1 ) &
step pytest_core 150 $PT tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py tests/test_tuning_gpu.py
wait
step new_fwd 120 $PT tests/test_sm90_sched_gpu.py tests/test_sm90_varlen_gpu.py tests/test_varlen_gpu.py tests/test_features_gpu.py
step new_bwd 120 $PT tests/test_sm90_bwd_d64_gpu.py tests/test_bwd_pre_gpu.py tests/test_sm90_bwd_gpu.py tests/test_sm90_bwd_features_gpu.py -k "not every_point"
step dropout 100 $PT tests/test_sm90_dropout_gpu.py tests/test_dropout_gpu.py tests/test_dropmix_gpu.py
step decode 80 $PT tests/test_decode_tma_gpu.py tests/test_decode_gpu.py -k "not long_context"
step memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu_sanitize.py
for fam in sm90_fwd sm90_bwd fa2_bwd decode_splitkv; do
  step "racecheck_$fam" 40 compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu_sanitize.py --quick --families "$fam"
done
step synccheck 40 compute-sanitizer --tool synccheck --error-exitcode 1 python3 tests/gpu_sanitize.py --families sm90_fwd sm90_bwd
cd $OUT && tar czf logs.tgz logs
