#!/usr/bin/env bash
# round A: the helpers' GPU tests and timing scripts on the integration tree
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; R=$OUT/logs/json; mkdir -p $L $R
START=$(date +%s); BUDGET=${BUDGET:-570}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
PT="python3 -m pytest -m gpu -q -p no:cacheprovider"
export CUDA_LAUNCH_BLOCKING=1
step t_softcap 120 $PT -x tests/test_sm90_softcap_gpu.py
step t_bwdsched 150 $PT -x tests/test_sm90_bwd_sched_gpu.py
step t_decode_fused 120 $PT -x tests/test_decode_fused_gpu.py
step t_fp8prep 90 $PT -x tests/test_fp8_prepare_gpu.py tests/test_fp8_gpu.py
step t_api12 90 $PT -x tests/test_api12_gpu.py
unset CUDA_LAUNCH_BLOCKING
step tm_bwdsched 120 python3 tests/sm90_bwd_sched_timing.py --out $R/bwdsched.json
step tm_softcap 60 python3 tests/sm90_softcap_timing.py --out $R/softcap.json
step tm_decode 120 python3 tests/decode_timing.py --out $R/decode.json
step tm_fp8 60 python3 tests/fp8_timing.py --out $R/fp8.json
cd $OUT && tar czf logs.tgz logs
