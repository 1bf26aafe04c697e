#!/usr/bin/env bash
# session 17 final round F2b at the merged main: fp16 benches, then the sm90 tune (bench-like timing)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
pip install -q --no-deps --target /tmp/site whl/*.whl > $L/pip.log 2>&1
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt
R=$OUT/res; mkdir -p $R
step() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log; }
step fwdbwd_fp16 170 python3 -m cuflash bench --mode fwdbwd --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
step fwd_fp16 110 python3 -m cuflash bench --mode fwd --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
T=${TUNE_S:-250}
step tune $((T + 20)) python3 -m cuflash tune --family sm90_fwd,sm90_bwd --dtype bf16 --hdim 64,128,256 --causal both --seqlen 2048,4096,8192,16384 --candidates 5 --reps 8 --seed 0 --storage memory --timeout $T --table-dir $OUT/table --out $OUT/tune --no-progress --no-plots
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res table tune 2>/dev/null || tar czf logs.tgz logs res
