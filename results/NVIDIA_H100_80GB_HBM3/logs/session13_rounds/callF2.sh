#!/usr/bin/env bash
# final round F2 at merged HEAD: benchmarks next to SDPA flash and cuDNN
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
R=$OUT/res
step fwd 110 python3 -m cuflash bench --mode fwd --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step fwdbwd 120 python3 -m cuflash bench --mode fwdbwd --hdims 64 128 --seqlens 2048 4096 8192 16384 --out $R
step features 150 python3 -m cuflash bench --mode features --out $R
step decode 90 python3 -m cuflash bench --mode decode --out $R
step overhead 60 python3 -m cuflash bench --mode overhead --out $R
cd $OUT && tar czf logs.tgz logs res
