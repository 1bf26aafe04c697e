#!/usr/bin/env bash
# session 18 final round F2 at the merged main: bench fwd+bwd and fwd (bf16, fp16), decode, host overhead,
# the feature backwards against the plain call (same process)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt
R=$OUT/res; mkdir -p $R
step() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log; }
step fwdbwd 265 python3 -m cuflash bench --mode fwdbwd --dtypes bf16 fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step fwd 120 python3 -m cuflash bench --mode fwd --dtypes bf16 fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step decode 50 python3 -m cuflash bench --mode decode --out $R
step overhead 30 python3 -m cuflash bench --mode overhead --out $R
step features 50 python3 tests/sm90_bwd_features_timing.py --reps 5 --variants heur --out $R/features_bwd_session18.json
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res
