#!/usr/bin/env bash
# session 18 final round F2b at the merged main: fp16 benches, start-up, feature overheads, dropout
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt
R=$OUT/res; mkdir -p $R
step() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log; }
step fwdbwd_fp16 250 python3 -m cuflash bench --mode fwdbwd --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
step fwd_fp16 110 python3 -m cuflash bench --mode fwd --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
step startup 80 python3 -m cuflash bench --mode startup --out $R
FEAT5_TIMING
step dropout 60 python3 tests/sm90_dropout_timing.py --hdims 128 --reps 8 --quick --out $R/dropout_timing_final.json
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res
