#!/usr/bin/env bash
# session 14, first call at HEAD: the GPU tests that did not finish at the end of session 13, then the benchmarks
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
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
git rev-parse HEAD > $L/rev.txt 2>/dev/null || true
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30"
t0=$(date +%s)
( timeout 170 $PT tests/test_flash_fwd_gpu.py -k persistent_tiles > $L/t_persist.log 2>&1; echo "persist rc=$?" >> $L/steps.log ) &
( timeout 170 $PT tests/test_sm90_sched_gpu.py > $L/t_sched.log 2>&1; echo "sched rc=$?" >> $L/steps.log ) &
( timeout 170 $PT tests/test_sm90_varlen_gpu.py tests/test_varlen_gpu.py > $L/t_varlen.log 2>&1; echo "varlen rc=$?" >> $L/steps.log ) &
( timeout 170 $PT tests/test_features_gpu.py > $L/t_features.log 2>&1; echo "features rc=$?" >> $L/steps.log ) &
wait
echo "tests $(( $(date +%s) - t0 ))s" >> $L/steps.log
for f in $L/t_*.log; do echo "$f: $(tail -1 $f)" >> $L/steps.log; done
R=$OUT/res
step fwd 110 python3 -m cuflash bench --mode fwd --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step fwdbwd 140 python3 -m cuflash bench --mode fwdbwd --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step decode 80 python3 -m cuflash bench --mode decode --out $R
step overhead 50 python3 -m cuflash bench --mode overhead --out $R
cd $OUT && tar czf logs.tgz logs res
