#!/usr/bin/env bash
# round B1: decode bisect, sched tests, decode regression, tuning (sm90_bwd with its new flags, FP8), decode timing
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; R=$OUT/logs/json; mkdir -p $L $R
START=$(date +%s); BUDGET=${BUDGET:-575}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
pip install -q --no-deps --target /tmp/site .whl/*.whl > $L/pip.log 2>&1
PT="python3 -m pytest -m gpu -q -p no:cacheprovider"
step precompile 90 python3 tests/gpu_precompile.py --processes 16
step bisect 90 python3 decode_bisect.py
CUDA_LAUNCH_BLOCKING=1 step t_sched 150 $PT tests/test_sm90_bwd_sched_gpu.py
step t_decode 120 $PT -x tests/test_decode_gpu.py
step tune_bwd 200 python3 -m cuflash tune --op bwd --family sm90_bwd --trials 14 --dtype bf16,fp16 --hdim 64,128 --causal both --seqlen 2048,4096,8192,16384 --table-dir tuning/configs --no-progress --no-plots
step tune_fp8 100 python3 -m cuflash tune --op fwd --dtype e4m3 --trials 8 --hdim 64,128,256 --causal both --seqlen 2048,4096,8192,16384 --table-dir tuning/configs --no-progress --no-plots
step tm_decode 90 python3 tests/decode_timing.py --out $R/decode.json
mkdir -p $OUT/tables && cp tuning/configs/*.yaml $OUT/tables/ 2>/dev/null
cp -r results $OUT/results_tree 2>/dev/null
cd $OUT && tar czf logs.tgz logs tables results_tree
