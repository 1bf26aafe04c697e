#!/usr/bin/env bash
# session 19 call 1 (lead): the sm90_bwd tune (CuPy backward now caches its plan), bench fwd bf16 + fp16,
# start-up and host overhead (the CuPy backward's host path is new in the overhead bench)
set -u
EXTRA_PYTHONPATH=/tmp/site
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
pip install -q --no-deps --target /tmp/site whl/*.whl > $L/pip.log 2>&1
R=$OUT/res; mkdir -p $R
step tune_sm90_bwd 170 python3 -m cuflash tune --family sm90_bwd --dtype bf16,fp16 --hdim 64,128,256 --causal both --seqlen 2048,4096,8192,16384 --candidates 5 --reps 8 --seed 0 --storage memory --timeout 150 --table-dir $OUT/table_sm90_bwd --out $OUT/tune_sm90_bwd --no-progress --no-plots
step fwd 90 python3 -m cuflash bench --mode fwd --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step fwd_fp16 110 python3 -m cuflash bench --mode fwd --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
step overhead 45 python3 -m cuflash bench --mode overhead --out $R
step startup 100 python3 -m cuflash bench --mode startup --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res table_* tune_* 2>/dev/null; rm -rf logs res table_* tune_*
