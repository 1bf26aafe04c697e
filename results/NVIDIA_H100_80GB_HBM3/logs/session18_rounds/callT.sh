#!/usr/bin/env bash
# session 18: the sm90_fwd / sm90_bwd tune (bench-like timing) at the merged main
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
pip install -q --no-deps --target /tmp/site whl/*.whl > $L/pip.log 2>&1
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt
step() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log; }
T=${TUNE_S:-250}
for fam in sm90_fwd sm90_bwd; do
step tune_$fam $((T + 20)) python3 -m cuflash tune --family $fam --dtype bf16,fp16 --hdim 64,128,256 --causal both --seqlen 2048,4096,8192,16384 --candidates 5 --reps 8 --seed 0 --storage memory --timeout $T --table-dir $OUT/table_$fam --out $OUT/tune_$fam --no-progress --no-plots
done
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs table_* tune_* 2>/dev/null || tar czf logs.tgz logs
