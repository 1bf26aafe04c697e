#!/usr/bin/env bash
# round B3: the features GPU tests, then fwd (+FP8), fwd+bwd and memory benchmarks
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L
START=$(date +%s); BUDGET=${BUDGET:-585}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
PT="python3 -m pytest -m gpu -q -p no:cacheprovider"
G=results/NVIDIA_H100_80GB_HBM3
step precompile 90 python3 tests/gpu_precompile.py --processes 16
step fwdbwd 110 python3 -m cuflash bench --mode fwdbwd --hdims 64 128 --seqlens 2048 4096 8192 16384
step fwd 110 python3 -m cuflash bench --mode fwd --fp8 --hdims 64 128 256 --seqlens 2048 4096 8192 16384
step memory 40 python3 -m cuflash bench --mode memory
step features 120 $PT tests/test_features_gpu.py
step small 100 $PT tests/test_varlen_gpu.py tests/test_dropout_gpu.py tests/test_fp8_gpu.py tests/test_window_gpu.py tests/test_api12_gpu.py tests/test_varlen_paged_gpu.py
step varlen_features 60 $PT tests/test_varlen_features_gpu.py
mkdir -p $OUT/res && cp $G/bench_fwd.* $G/bench_fwdbwd.* $G/memory.* $OUT/res/ 2>/dev/null
cd $OUT && tar czf logs.tgz logs res
